// Draws conversation entries. Everything the model or the user wrote goes in with textContent, so no
// answer can add markup, run a script or load a resource: the page shows exactly the characters sent.
//
// An entry is plain data (what store.js keeps):
//   chat:       {role: "user" | "assistant", content, images?, reasoning?, state?, error?, stats?}
//               (images: the data: URLs a user message sent, shown as pictures; img-src allows data: only)
//   completion: {role: "completion", prompt, content, state?, error?, stats?}
// state is "streaming", "done", "stopped" or "error"; stats is {ttftMs, tokens, tokensPerSecond, finish}.

const TITLES = {user: "You", assistant: "Assistant", completion: "Completion"};

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// A new element for `entry`; update(node, entry) refreshes it as the entry grows.
export function render(entry) {
  const node = element("article", `message ${entry.role}`);
  node.dataset.role = entry.role;
  node.append(element("h2", "who", TITLES[entry.role] || entry.role));
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "Reasoning"), element("div", "reasoning-text"));
  const content = element("div", "content");
  if (entry.role === "completion") content.append(element("span", "prompt"), element("span", "generated"));
  const thumbs = element("div", "thumbs");
  for (const url of entry.images || []) {
    const image = element("img");
    image.alt = "image sent";
    image.src = url;
    thumbs.append(image);
  }
  node.append(reasoning, thumbs, content, element("p", "error"), element("p", "stats"));
  update(node, entry);
  return node;
}

export function update(node, entry) {
  node.dataset.state = entry.state || "done";
  const reasoning = node.querySelector(".reasoning");
  reasoning.hidden = !entry.reasoning;
  reasoning.querySelector(".reasoning-text").textContent = entry.reasoning || "";
  if (entry.role === "completion") {
    node.querySelector(".prompt").textContent = entry.prompt;
    node.querySelector(".generated").textContent = entry.content;
  } else {
    node.querySelector(".content").textContent = entry.content;
  }
  const error = node.querySelector(".error");
  error.hidden = !entry.error;
  error.textContent = entry.error || "";
  const stats = node.querySelector(".stats");
  stats.hidden = !entry.stats;
  stats.textContent = entry.stats ? statsText(entry.stats, entry.state) : "";
  if (entry.stats) {
    stats.dataset.tokens = entry.stats.tokens ?? 0;
    stats.dataset.ttftMs = entry.stats.ttftMs ?? "";
  }
}

// "TTFT 84 ms · 151.3 tok/s · 57 tokens · length": the answer's time to first token, its decode speed
// (tokens after the first over the time since the first), its length and why it ended.
export function statsText(stats, state) {
  const parts = [];
  if (stats.ttftMs !== undefined) parts.push(`TTFT ${Math.round(stats.ttftMs)} ms`);
  if (stats.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
  if (stats.tokens !== undefined) parts.push(`${stats.tokens} token${stats.tokens === 1 ? "" : "s"}`);
  if (state === "streaming") parts.push("…");
  else if (state === "stopped") parts.push("stopped");
  else if (stats.finish) parts.push(stats.finish === "length" ? "length (max tokens)" : stats.finish);
  return parts.join(" · ") || (state === "streaming" ? "waiting for the first token…" : "");
}
