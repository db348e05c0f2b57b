// The playground page: chat and raw completion against this server, streamed as the model writes.
//
// 1. On load: restore the settings and both conversations (store.js), then list the models. A 401 opens
//    the API-key dialog; a 503 (the model still compiling) is retried until the server is ready.
// 2. Send (the button, or Enter; Shift+Enter is a new line; or the empty page's suggested first prompt)
//    appends the user's text and an empty answer, builds the request from the conversation and the
//    settings, and streams it (api.js). Each chunk grows the answer in place and updates its TTFT and
//    tokens per second.
// 3. Stop aborts the fetch: the server sees the connection close and ends the request. Regenerate
//    replaces the last answer with a fresh one. The conversation is saved at each step, so a reload
//    keeps it (an answer cut by the reload is marked stopped).
// 4. Vision models (their /v1/models entry lists "image" among its input_modalities) show an image control:
//    pick, paste or drop images; each is read as a data: URL and sent with the message as an OpenAI
//    `image_url` part. For a text-only model the control is hidden and nothing is attached.

import {AuthError, Client} from "./api.js";
import {store} from "./store.js";
import {render, update} from "./transcript.js";

const $ = (id) => document.getElementById(id);
const FIELDS = ["system", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop_strings", "json_schema",
                "extra"];
const DEFAULTS = {max_tokens: "256"};
const PATHS = {chat: "v1/chat/completions", completion: "v1/completions"};

const state = {
  mode: store.mode() === "completion" ? "completion" : "chat",
  history: {chat: store.history("chat"), completion: store.history("completion")},
  running: null,  // {controller, entry} while an answer streams
  apiKey: store.apiKey(),
  models: [],
  attachments: [],  // data: URLs of the images the next message sends
};
const client = new Client(() => state.apiKey);

// ---- settings ----------------------------------------------------------------------------------------

function restoreSettings() {
  const saved = {...DEFAULTS, ...store.settings()};
  for (const name of FIELDS) $(name).value = saved[name] ?? "";
}

function saveSettings() {
  store.saveSettings(Object.fromEntries(FIELDS.map((name) => [name, $(name).value])));
}

// A JSON box's value (undefined when empty); a parse error is shown beside the box and thrown.
function jsonField(name, mustBeObject) {
  const text = $(name).value.trim();
  const error = $(`${name}-error`);
  error.hidden = true;
  if (!text) return undefined;
  let value;
  try {
    value = JSON.parse(text);
  } catch (e) {
    error.textContent = `Not valid JSON: ${e.message}`;
    error.hidden = false;
    throw new Error(`${$(name).labels[0].firstChild.textContent.trim()}: not valid JSON`);
  }
  if (mustBeObject && (typeof value !== "object" || value === null || Array.isArray(value))) {
    error.textContent = "Must be a JSON object";
    error.hidden = false;
    throw new Error(`${$(name).labels[0].firstChild.textContent.trim()}: must be a JSON object`);
  }
  return value;
}

function numberField(name) {
  const text = $(name).value.trim();
  if (!text) return undefined;
  const value = Number(text);
  if (!Number.isFinite(value)) throw new Error(`${name} must be a number`);
  return value;
}

// The request fields the settings ask for; empty fields are left out, so the server's defaults apply.
function samplingFields() {
  const fields = {...jsonField("extra", true)};
  for (const name of ["temperature", "top_p", "top_k", "max_tokens", "seed"]) {
    const value = numberField(name);
    if (value !== undefined) fields[name] = value;
  }
  const stop = $("stop_strings").value.split("\n").filter((line) => line !== "");
  if (stop.length) fields.stop = stop;
  const schema = jsonField("json_schema", true);
  if (schema !== undefined) {
    fields.response_format = {type: "json_schema", json_schema: {name: "playground", schema, strict: true}};
  }
  return fields;
}

// ---- requests ----------------------------------------------------------------------------------------

function requestBody(entry, fields) {
  const body = {...fields, stream: true, stream_options: {include_usage: true, continuous_usage_stats: true}};
  if ($("model").value) body.model = $("model").value;
  if (entry.role === "completion") return {...body, prompt: entry.prompt};
  const before = state.history.chat.slice(0, state.history.chat.indexOf(entry));
  const messages = before.filter((m) => m.content || m.role === "user")
                         .map((m) => ({role: m.role, content: contentOf(m)}));
  const system = $("system").value;
  return {...body, messages: system ? [{role: "system", content: system}, ...messages] : messages};
}

// A message's content: its text, or with images OpenAI's parts (the images first, then the text).
function contentOf(message) {
  if (!message.images || !message.images.length) return message.content;
  const parts = message.images.map((url) => ({type: "image_url", image_url: {url}}));
  return message.content ? [...parts, {type: "text", text: message.content}] : parts;
}

async function run(entry, fields) {
  const mode = state.mode;
  const controller = new AbortController();
  state.running = {controller, entry};
  Object.assign(entry, {content: "", reasoning: "", error: "", state: "streaming", stats: {}});
  const node = drawEntry(entry);
  refreshControls();
  save(mode);
  const stats = entry.stats;
  const started = performance.now();
  let first = null;  // [time, tokens] at the first token
  let chunks = 0;
  try {
    await client.stream(PATHS[mode], requestBody(entry, fields), controller.signal, (chunk) => {
      const choice = (chunk.choices || [])[0];
      const piece = choice ? (mode === "chat" ? choice.delta?.content : choice.text) : "";
      const thought = choice?.delta?.reasoning_content;
      const now = performance.now();
      if (piece) entry.content += piece;
      if (thought) entry.reasoning += thought;
      if (piece || thought) chunks += 1;
      if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
      else if (piece || thought) stats.tokens = chunks;
      if ((piece || thought) && first === null) {
        stats.ttftMs = now - started;
        first = [now, stats.tokens];
      } else if (first && stats.tokens > first[1] && now > first[0]) {
        stats.tokensPerSecond = (stats.tokens - first[1]) / ((now - first[0]) / 1000);
      }
      if (choice?.finish_reason) stats.finish = choice.finish_reason;
      update(node, entry);
    });
    entry.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      entry.state = "stopped";
    } else {
      entry.state = "error";
      entry.error = e.message || String(e);
      if (e instanceof AuthError) askForKey(e.message);
    }
  } finally {
    state.running = null;
    update(node, entry);
    save(mode);
    refreshControls();
  }
}

function send() {
  if (state.running) return;
  const text = $("prompt").value;
  const images = takesImages() ? state.attachments : [];
  if (!text.trim() && !images.length) return;
  let fields;
  try {
    fields = samplingFields();
  } catch (e) {
    setStatus(e.message);
    return;  // the typed text stays, so it can be sent once the setting is fixed
  }
  const history = state.history[state.mode];
  let entry;
  if (state.mode === "chat") {
    history.push(images.length ? {role: "user", content: text, images} : {role: "user", content: text});
    entry = {role: "assistant", content: ""};
    setAttachments([]);
  } else {
    entry = {role: "completion", prompt: text, content: ""};
  }
  history.push(entry);
  $("prompt").value = "";
  drawTranscript();
  run(entry, fields);
}

function regenerate() {
  if (state.running) return;
  const history = state.history[state.mode];
  let entry = history[history.length - 1];
  if (!entry) return;
  let fields;
  try {
    fields = samplingFields();
  } catch (e) {
    setStatus(e.message);
    return;
  }
  if (entry.role === "user") {  // its answer failed to start: answer it now
    entry = {role: "assistant", content: ""};
    history.push(entry);
    drawTranscript();
  }
  run(entry, fields);
}

// ---- drawing -----------------------------------------------------------------------------------------

const nodes = new WeakMap();  // entry -> its element

function drawTranscript() {
  const transcript = $("transcript");
  for (const node of transcript.querySelectorAll("article")) node.remove();
  const history = state.history[state.mode];
  $("empty-hint").hidden = history.length > 0;
  for (const entry of history) {
    const node = render(entry);
    nodes.set(entry, node);
    transcript.append(node);
  }
  transcript.scrollTop = transcript.scrollHeight;
}

function drawEntry(entry) {
  const node = nodes.get(entry);
  update(node, entry);
  node.scrollIntoView({block: "end"});
  return node;
}

function refreshControls() {
  const busy = state.running !== null;
  const history = state.history[state.mode];
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || history.length === 0;
  $("clear").disabled = busy;
  for (const radio of document.querySelectorAll("input[name=mode]")) radio.disabled = busy;
  $("transcript").setAttribute("aria-busy", String(busy));
  document.body.classList.toggle("completion-mode", state.mode === "completion");
}

function setStatus(text) {
  $("server-status").textContent = text;
}

function save(mode) {
  store.saveHistory(mode, state.history[mode]);
}

// ---- images (vision models) -------------------------------------------------------------------------

function takesImages() {
  const model = state.models.find((m) => m.id === $("model").value);
  return Boolean(model && (model.input_modalities || []).includes("image"));
}

function refreshImageControls() {
  $("image-controls").hidden = !takesImages();
  if (!takesImages()) setAttachments([]);
}

function setAttachments(urls) {
  state.attachments = urls;
  const shown = urls.map((url, i) => {
    const item = document.createElement("span");
    const image = document.createElement("img");
    image.src = url;
    image.alt = `image ${i + 1} to send`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `remove image ${i + 1}`);
    remove.addEventListener("click", () => setAttachments(state.attachments.filter((_, j) => j !== i)));
    item.append(image, remove);
    return item;
  });
  $("attachments").replaceChildren(...shown);
}

// Image files (picked, pasted or dropped) -> data: URLs appended to the attachments.
async function attach(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  if (!images.length || !takesImages()) return false;
  const urls = await Promise.all(images.map((file) => new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  })));
  setAttachments([...state.attachments, ...urls]);
  return true;
}

// ---- models and the API key ----------------------------------------------------------------------------

async function loadModels() {
  try {
    state.models = await client.listModels();
  } catch (e) {
    if (e instanceof AuthError) {
      setStatus("needs an API key");
      askForKey(state.apiKey ? "The server refused this key." : "This server needs an API key (--api-key).");
    } else if (e.status === 503) {
      setStatus(`${e.message}…`);
      setTimeout(loadModels, 2000);
    } else {
      setStatus(`cannot list the models (${e.message}); retrying…`);
      setTimeout(loadModels, 5000);
    }
    return;
  }
  const select = $("model");
  const wanted = select.value || store.model();
  select.replaceChildren(...state.models.map((m) => new Option(m.id, m.id)));
  if (state.models.some((m) => m.id === wanted)) select.value = wanted;
  const model = state.models.find((m) => m.id === select.value);
  refreshImageControls();
  setStatus(model && model.max_model_len ? `context ${model.max_model_len} tokens` : "ready");
}

function askForKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason;
  $("key-button").hidden = false;
  if (!dialog.open) dialog.showModal();
  $("api-key").focus();
}

// ---- wiring ------------------------------------------------------------------------------------------

function setMode(mode) {
  state.mode = mode;
  store.saveMode(mode);
  drawTranscript();
  refreshControls();
}

function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.running && !$("key-dialog").open) state.running.controller.abort();
  });
  for (const button of document.querySelectorAll("#empty-hint .suggestion")) {  // sends its prompt at once
    button.addEventListener("click", () => {
      $("prompt").value = button.dataset.prompt;
      send();
    });
  }
  $("stop").addEventListener("click", () => state.running && state.running.controller.abort());
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => {
    state.history[state.mode] = [];
    save(state.mode);
    drawTranscript();
    refreshControls();
  });
  for (const radio of document.querySelectorAll("input[name=mode]")) {
    radio.checked = radio.value === state.mode;
    radio.addEventListener("change", () => radio.checked && setMode(radio.value));
  }
  $("model").addEventListener("change", () => {
    store.saveModel($("model").value);
    refreshImageControls();
  });
  $("image-file").addEventListener("change", async (e) => {
    await attach(e.target.files);
    e.target.value = "";  // the same file may be picked again
  });
  $("prompt").addEventListener("paste", (e) => {
    const files = e.clipboardData ? e.clipboardData.files : [];
    if (files.length && takesImages()) {
      e.preventDefault();
      attach(files);
    }
  });
  $("composer").addEventListener("dragover", (e) => {
    if (!takesImages()) return;
    e.preventDefault();
    $("composer").classList.add("dropping");
  });
  $("composer").addEventListener("dragleave", () => $("composer").classList.remove("dropping"));
  $("composer").addEventListener("drop", (e) => {
    $("composer").classList.remove("dropping");
    if (!takesImages() || !e.dataTransfer) return;
    e.preventDefault();
    attach(e.dataTransfer.files);
  });
  $("settings-form").addEventListener("submit", (e) => e.preventDefault());
  $("settings-form").addEventListener("input", (e) => {
    saveSettings();
    if (e.target.id === "json_schema" || e.target.id === "extra") {
      try {
        jsonField(e.target.id, true);
      } catch {
        // shown beside the box
      }
    }
  });
  $("reset-settings").addEventListener("click", () => {
    store.saveSettings({});
    restoreSettings();
  });
  $("settings-toggle").addEventListener("click", () => {
    const open = $("settings").classList.toggle("open");
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  $("key-button").addEventListener("click", () => askForKey("The key this tab sends as a Bearer token."));
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.apiKey = $("api-key").value.trim();
    store.saveApiKey(state.apiKey);
    $("key-dialog").close();
    loadModels();
  });
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
}

function start() {
  for (const mode of ["chat", "completion"]) {  // an answer a reload cut off
    for (const entry of state.history[mode]) if (entry.state === "streaming") entry.state = "stopped";
  }
  restoreSettings();
  wire();
  drawTranscript();
  refreshControls();
  setStatus("connecting…");
  loadModels();
  $("prompt").focus();
}

start();
