// The playground's side of the OpenAI-compatible API.
//
// 1. Every URL is relative ("v1/models"), so the page works wherever the server is mounted, a reverse
//    proxy's prefix included.
// 2. The API key, when the server needs one, goes as a Bearer token; a 401 becomes AuthError, so the page
//    can ask for the key; any other error body becomes APIError with the server's own message.
// 3. A streamed answer is read with fetch and a ReadableStream reader (EventSource can neither POST nor
//    send headers): bytes are decoded as they come, split into server-sent events at blank lines, and
//    each `data:` JSON handed to the caller, until `data: [DONE]`. Aborting the request's signal stops the
//    read and closes the connection, which the server takes as the client leaving and ends the request.

export class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export class AuthError extends APIError {}

export class Client {
  constructor(getKey) {
    this.getKey = getKey;
  }

  headers() {
    const headers = {"Content-Type": "application/json"};
    const key = this.getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  async listModels() {
    const response = await fetch("v1/models", {headers: this.headers(), cache: "no-store"});
    if (!response.ok) throw await errorOf(response);
    const body = await response.json();
    return body.data || [];
  }

  // POST `path` with `body` (stream: true) and call onEvent(chunk) for each streamed JSON chunk.
  async stream(path, body, signal, onEvent) {
    const response = await fetch(path, {method: "POST", headers: this.headers(), body: JSON.stringify(body),
                                         signal, cache: "no-store"});
    if (!response.ok) throw await errorOf(response);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, {stream: true});
      let end;
      while ((end = eventEnd(buffered)) !== null) {
        const [cut, skip] = end;
        const data = dataOf(buffered.slice(0, cut));
        buffered = buffered.slice(cut + skip);
        if (data === null) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new APIError(500, chunk.error.message || "the server reported an error");
        onEvent(chunk);
      }
    }
    throw new APIError(0, "the connection closed before the answer ended");
  }
}

// [index where the event ends, length of the blank line after it], or null: events end at a blank line
// (the SSE format allows \n, \r\n and \r line ends).
function eventEnd(text) {
  const match = /\r\n\r\n|\n\n|\r\r/.exec(text);
  return match ? [match.index, match[0].length] : null;
}

// The event's data lines joined, or null for an event without data (a comment, a keep-alive).
function dataOf(event) {
  const lines = event.split(/\r\n|\n|\r/).filter((line) => line.startsWith("data:"));
  if (!lines.length) return null;
  return lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON (a proxy's error page): the status line says enough
  }
  return response.status === 401 ? new AuthError(401, message) : new APIError(response.status, message);
}
