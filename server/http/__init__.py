"""HTTP plumbing that knows no endpoint: the connection (a limit on a request's head), the listening
sockets, the guard every request passes (request id, API key, content type, body size), OpenAI's error
shape and server-sent events."""
