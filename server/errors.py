"""Errors in OpenAI's shape: the exception a handler raises, and the response it becomes."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from server.protocol import error_body


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
