"""What every HTTP request passes before a route sees it: an ASGI middleware, outermost in the app.

1. Request id: an `X-Request-Id` header is kept (a new one is made when absent or unusable) and echoed
   on the response, so a client can quote it and the logs can find it. With --enable-request-id-headers
   the routes also use it as the response's and the engine's id, so an unusable one (not 1-128
   printable ASCII characters) is refused with a 400 instead of replaced.
2. Authentication (`--api-key`): every path but `/health` and the playground's page and files needs
   `Authorization: Bearer <key>`. The key is compared in constant time, and the decision uses the path
   the router matches (the ASGI scope's, less a `--root-path` mount point), never a header a client sets
   (Host, X-Forwarded-*), so no crafted request reaches a route unauthenticated.
3. Content type: a request with a body must declare `application/json`, or it is refused with 415. A
   browser may post `text/plain` to a loopback server without a CORS preflight; it cannot post JSON.
4. Body size (`--max-request-body-bytes`): a `Content-Length` over the limit is refused with 413 before
   a byte of the body is read; otherwise the body is read here, counted as it arrives (a chunked body
   is cut off at the limit the same way), and handed to the route in one piece.
Refusals are OpenAI error JSON and carry `Connection: close`, since the rest of the body is not read.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid

from server.http.errors import error_body

# Where the web playground (server/playground/) serves its page and its files: public, since the page must
# load before it can ask for the key. The playground takes its paths from here.
PLAYGROUND_PAGES = ("/", "/playground")
PLAYGROUND_FILES = "/playground/"
PUBLIC_PATHS = frozenset({"/health", *PLAYGROUND_PAGES})
# The playground's files, by name (no folders, no dots but the extension's).
_PUBLIC_FILE = re.compile("^" + re.escape(PLAYGROUND_FILES) + r"[\w-]+\.(?:css|js)$")
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces: safe in a header, a log, JSON


class RequestGuard:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, request_id_headers: bool = False):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.request_id_headers = request_id_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        usable = _REQUEST_ID.match(given) is not None
        request_id = given if usable else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["client_request_id"] = request_id, given if usable else None
        echo = (b"x-request-id", request_id.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), echo]}
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await _refuse(send_with_id, *refusal, request_id)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send_with_id)

        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _refuse(send_with_id, 413, *self._too_large(), request_id)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: the disconnect a streaming route watches for
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send_with_id)

    def _refusal(self, scope, headers: dict) -> tuple | None:
        if self.api_key is not None and not _is_public(_route_path(scope)):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                return 401, "Invalid or missing API key: send `Authorization: Bearer <key>`", \
                    "authentication_error", None, "invalid_api_key"
        if self.request_id_headers and "x-request-id" in headers and not _REQUEST_ID.match(headers["x-request-id"]):
            return 400, "X-Request-Id must be 1 to 128 printable ASCII characters without spaces", \
                "invalid_request_error", None, "invalid_request_id"
        length = headers.get("content-length")
        has_body = (length not in (None, "0")) or "transfer-encoding" in headers
        if has_body:
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                return 415, f"Content-Type must be application/json, got {media_type or 'none'!r}", \
                    "invalid_request_error", None, "unsupported_media_type"
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return (413, *self._too_large())
        return None

    def _too_large(self) -> tuple:
        return (f"Request body exceeds the limit of {self.max_body_bytes} bytes (--max-request-body-bytes)",
                "invalid_request_error", None, "request_too_large")


def client_request_id(request) -> str | None:
    """The X-Request-Id the client sent, when it is usable as an id (see 1.); None otherwise."""
    return request.scope.get("state", {}).get("client_request_id")


def _route_path(scope) -> str:
    """The path the router matches: uvicorn puts --root-path in front of the path the proxy forwarded."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


def _is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or _PUBLIC_FILE.match(path) is not None


async def _refuse(send, status: int, message: str, type_: str, param, code, request_id: str) -> None:
    body = json.dumps(error_body(message, type_, param, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
