"""Server-sent events: how a streamed reply goes out.

1. `sse(payload)` writes one `data:` event (JSON, UTF-8 as it is: no `\\u` escapes).
2. `sse_response(events)` is the streaming response, with the headers that keep proxies from buffering it.
3. `event_stream(events, request_id)` is that response for the OpenAI routes: a failure once the headers
   are out cannot change the status, so it is reported in the stream as an error event, then
   `data: [DONE]` ends it, as clients of those routes expect. (The Responses API reports its own way.)
"""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from server.http.errors import internal_error

logger = logging.getLogger(__name__)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def event_stream(events: AsyncIterator[str], request_id: str) -> StreamingResponse:
    async def guarded():
        try:
            async for event in events:
                yield event
        except Exception:
            logger.exception("stream %s failed", request_id)
            yield sse(internal_error(request_id).body)
            yield "data: [DONE]\n\n"
    return sse_response(guarded())
