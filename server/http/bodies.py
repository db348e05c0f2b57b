"""A request body read into its pydantic model: the first half of a request's validation (the second is the
engine's check of its prompts, server/serving/engine_client.py).

1. The guard has already bounded the body's size. It must be JSON, an object, nested no deeper than
   Python's parser can go, and every string in it valid Unicode.
2. The model checks every field's type and range; the first failure is a 400 naming the field.
3. Fields nobody knows are ignored with a warning in the log, as vLLM does (`RequestBody.unknown_fields`).
"""

from __future__ import annotations

import json
import logging
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from server.http.errors import APIError, check_strings, request_id_of, validation_error

logger = logging.getLogger(__name__)


class RequestBody(BaseModel):
    """A request body's model: fields it does not know are kept, to be named in the log, not refused."""
    model_config = ConfigDict(extra="allow")

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


Body = TypeVar("Body", bound=RequestBody)


async def read_body(request: Request, schema: type[Body]) -> Body:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, integers too long to convert
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    check_strings(data)
    try:
        body = schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, data) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply") from None
    if body.unknown_fields:
        logger.warning("request %s: ignored unknown fields %s", request_id_of(request), body.unknown_fields)
    return body
