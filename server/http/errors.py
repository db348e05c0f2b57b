"""Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`): the exception a handler
raises, the response it becomes, and the 400 a bad body gets (a pydantic error, a field refused by name, a
string that is not valid Unicode)."""

from __future__ import annotations

import re
import uuid

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class UnsupportedField(ValueError):
    """A field this server refuses by name, raised inside a pydantic validator (pydantic wraps it;
    `validation_error` reports its `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal error (request id {request_id})", "server_error", code="internal_error")


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex


def check_strings(value, path: str = "") -> None:
    """Every string in the body must be encodable UTF-8: JSON's \\ud800 escapes decode to lone surrogates,
    which no tokenizer (and no response) can carry."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path or 'body'}: the string is not valid Unicode (a lone surrogate)",
                           param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_strings(key, path)
            check_strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{path}.{i}")


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")  # pydantic's names for union members


def validation_error(e: ValidationError, data=None) -> APIError:
    """The first error as a 400 naming its field; a field refused by name (UnsupportedField) says why.
    `data`: what was validated, when the caller has it: the field's path is then read against it, which
    drops what pydantic adds to a location that the client never wrote (a tagged union's tag: a text part's
    `text` is `messages.0.content.0.text`, not `...content.0.text.text`)."""
    for error in e.errors():
        refused = (error.get("ctx") or {}).get("error")
        if isinstance(refused, UnsupportedField):
            return APIError(400, f"{refused.param}: {refused}", param=refused.param, code="unsupported_parameter")
    # For a union field pydantic reports one error per alternative: the deepest says the most.
    error = max(e.errors(), key=lambda err: len(err["loc"]))
    loc = [p for p in error["loc"] if not _UNION_TAG.match(str(p))]
    param = ".".join(str(p) for p in (_written(loc, data) if data is not None else loc)) or None
    return APIError(400, f"{param}: {error['msg']}" if param else error["msg"], param=param)


def _written(loc: list, data) -> list:
    """The steps of `loc` that name a key or an index of `data` as the client sent it."""
    kept = []
    for n, step in enumerate(loc):
        if isinstance(data, dict):
            if step not in data:
                if n == len(loc) - 1:
                    kept.append(step)  # the missing field itself
                continue  # a union's tag, not a field
            data = data[step]
        elif isinstance(data, list) and isinstance(step, int) and 0 <= step < len(data):
            data = data[step]
        else:
            break  # past a value the client sent (a tag named like its field comes first)
        kept.append(step)
    return kept
