// What the playground remembers, kept in the browser only.
//
// 1. Settings and both modes' conversations go to localStorage, so they outlive a reload and a closed
//    tab; the API key goes to sessionStorage, so it stays in this tab and is gone when the tab closes.
// 2. Keys are namespaced by the page's directory, so two servers behind one origin (different proxy
//    prefixes) keep separate conversations.
// 3. Storage can be missing or full (private windows, quotas): the page then works without memory.

const NAMESPACE = `jaxserve-playground:${new URL(".", location.href).pathname}:`;

function read(storage, name, fallback) {
  try {
    const text = storage.getItem(NAMESPACE + name);
    return text === null ? fallback : JSON.parse(text);
  } catch {
    return fallback;
  }
}

function write(storage, name, value) {
  try {
    if (value === null || value === undefined) storage.removeItem(NAMESPACE + name);
    else storage.setItem(NAMESPACE + name, JSON.stringify(value));
  } catch {
    // no storage, or over quota: keep going without it
  }
}

export const store = {
  settings: () => read(localStorage, "settings", {}),
  saveSettings: (settings) => write(localStorage, "settings", settings),
  mode: () => read(localStorage, "mode", "chat"),
  saveMode: (mode) => write(localStorage, "mode", mode),
  model: () => read(localStorage, "model", null),
  saveModel: (model) => write(localStorage, "model", model),
  history: (mode) => read(localStorage, `history-${mode}`, []),
  saveHistory: (mode, entries) => write(localStorage, `history-${mode}`, entries),
  apiKey: () => read(sessionStorage, "api-key", ""),
  saveApiKey: (key) => write(sessionStorage, "api-key", key || null),
};
