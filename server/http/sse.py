"""Server-sent events: how a streamed reply goes out.

1. `sse(payload)` writes one `data:` event (JSON, UTF-8 as it is: no `\\u` escapes).
2. `sse_response(events, on_close)` is the streaming response, with the headers that keep proxies from
   buffering it; `on_close` runs once the response is done, however it ended. A client gone before the
   first byte never starts `events` (Starlette cancels the sending on the disconnect it reads first), so
   what `events` would have released in its own `finally` is released there.
3. `event_stream(events, request_id, on_close)` is that response for the OpenAI routes: a failure once the headers
   are out cannot change the status, so it is reported in the stream as an error event, then
   `data: [DONE]` ends it, as clients of those routes expect. (The Responses API reports its own way.)
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from server.http.errors import internal_error

logger = logging.getLogger(__name__)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _ClosingStream(StreamingResponse):
    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_close is not None:
                self._on_close()


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> StreamingResponse:
    return _ClosingStream(events, on_close)


def event_stream(events: AsyncIterator[str], request_id: str,
                 on_close: Callable[[], None] | None = None) -> StreamingResponse:
    async def guarded():
        try:
            async for event in events:
                yield event
        except Exception:
            logger.exception("stream %s failed", request_id)
            yield sse(internal_error(request_id).body)
            yield "data: [DONE]\n\n"
    return sse_response(guarded(), on_close)
