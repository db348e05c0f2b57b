"""`/openapi.json`: the routes, described from the same pydantic models that validate the requests."""

from __future__ import annotations

from functools import lru_cache

from pydantic.json_schema import models_json_schema

from server.openai.embeddings import EmbeddingRequest
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.tokenize import DetokenizeRequest, TokenizeRequest
from server.responses.protocol import ResponsesRequest

MODELS = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, EmbeddingRequest, TokenizeRequest,
          DetokenizeRequest)
_ERROR = {"description": "OpenAI error JSON: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}


def _post(summary: str, schema_ref: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": schema_ref}}}},
        "responses": {"200": {"description": "the completion; `text/event-stream` chunks with \"stream\": true"},
                      "400": _ERROR, "401": _ERROR, "404": _ERROR, "413": _ERROR, "415": _ERROR,
                      "429": _ERROR, "503": _ERROR},
    }}


def _get(summary: str) -> dict:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}, "503": _ERROR}}}


@lru_cache(maxsize=4)
def openapi_document(root_path: str = "") -> dict:
    """`root_path` (--root-path): where a client reaches the routes behind the proxy."""
    refs, definitions = models_json_schema(
        [(model, "validation") for model in MODELS], ref_template="#/components/schemas/{model}")
    ref = {model: refs[(model, "validation")]["$ref"] for model in MODELS}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions, chat completions, responses and embeddings"},
        "servers": [{"url": root_path or "/"}],
        "paths": {
            "/v1/completions": _post("Create a completion", ref[CompletionRequest]),
            "/v1/chat/completions": _post("Create a chat completion", ref[ChatCompletionRequest]),
            "/v1/responses": _post("Create a model response (OpenAI's Responses API)", ref[ResponsesRequest]),
            "/v1/responses/{response_id}": {**_get("A stored response"), "delete": {
                "summary": "Delete a stored response", "responses": {"200": {"description": "OK"}, "404": _ERROR}}},
            "/v1/embeddings": _post("Create embeddings (a server started with --runner pooling)",
                                    ref[EmbeddingRequest]),
            "/tokenize": _post("Token ids of a prompt or of chat messages", ref[TokenizeRequest]),
            "/detokenize": _post("The text of token ids", ref[DetokenizeRequest]),
            "/v1/models": _get("The served model"),
            "/version": _get("The server's version"),
            "/health": _get("200 once the model is loaded and compiled"),
            "/metrics": _get("Prometheus metrics"),
        },
        "components": {"schemas": definitions.get("$defs", {}),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
