"""`POST /v1/embeddings`: OpenAI's embeddings API over the pooling runner (`--runner pooling`).

1. The body (`EmbeddingRequest`) takes `input` as a string, a list of strings, a list of token ids or a
   list of those, or (vLLM's chat-style request) `messages`, rendered by the chat template as for chat;
   `encoding_format` float or base64 (little-endian float32, what the `openai` client asks for by
   default); `dimensions` only where the model is Matryoshka (else a 400 naming it); vLLM's
   `truncate_prompt_tokens`, `add_special_tokens` and `normalize`. Other vLLM fields are refused by name.
2. Every input is admitted against the queue limit, tokenized on a worker thread and checked by the
   engine (`EngineClient.check_pooling`, the one check) before any is queued; then all run at once,
   batched by the engine with whatever else is running, and the answer lists them in input order with the
   prompt tokens as usage. A client that disconnects aborts what is left.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.pooling_requests import CheckedPooling
from jaxserve.entrypoints.async_engine import EngineDeadError
from jaxserve.pooling.params import EmbeddingRequestOutput, PoolingParams
from server.http.bodies import RequestBody
from server.http.errors import (
    APIError,
    UnsupportedField,
    error_response,
    internal_error,
    request_id_of,
    validation_error,
)
from server.openai.prompts import render_chat
from server.openai.protocol import MAX_PROMPTS, ChatCompletionRequest, ChatMessage
from server.serving.admission import Places, failed_before_engine
from server.serving.context import ServingContext

# vLLM fields of its embedding request that this server refuses unless they keep their default.
_UNSUPPORTED = {
    "priority": (0, "priority scheduling is not enabled"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "embed_dtype": ("float32", "embed_dtype other than float32 is not supported"),
    "use_activation": (None, "use_activation is not supported by embedding models; use normalize"),
}


class EmbeddingRequest(RequestBody):
    model_config = ConfigDict(allow_inf_nan=False)

    input: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's chat-style request instead of `input`: the messages rendered by the chat template, embedded whole.
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None  # default: true for input, false for messages (the template has them)
    normalize: bool | None = None
    request_id: str | None = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        if isinstance(value, list) and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} inputs per request")
        items = value if isinstance(value, list) and not isinstance(value[0], int) else [value]
        if any(len(item) == 0 for item in items):
            raise ValueError("an input must not be empty (an empty string or an empty list of token ids)")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if (self.input is None) == (self.messages is None):
            raise UnsupportedField("input", "give input, or messages (a chat to embed): exactly one of them")
        for name, (default, why) in _UNSUPPORTED.items():
            if (self.model_extra or {}).get(name, default) != default:
                raise UnsupportedField(name, why)
        return self

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - set(_UNSUPPORTED))

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)

    def as_chat(self) -> ChatCompletionRequest:
        """The messages as a chat request, for the server's chat template rendering."""
        try:
            return ChatCompletionRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                                         continue_final_message=self.continue_final_message,
                                         chat_template=self.chat_template,
                                         chat_template_kwargs=self.chat_template_kwargs)
        except ValidationError as e:
            raise validation_error(e) from None


async def embeddings_route(ctx: ServingContext, request: Request) -> Response:
    places = Places()
    try:
        ctx.require_ready()
        body = await ctx.parse(request, EmbeddingRequest)
        inputs = [await run_in_threadpool(render_chat, ctx, body.as_chat())] if body.messages else body.inputs()
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        places = ctx.admission.admit(len(inputs))
        for item in inputs:
            if isinstance(item, str) and body.truncate_prompt_tokens is None:  # too long to be worth tokenizing
                ctx.model.prompt_fits(item, "input")
        tok = ctx.model.tokenizer
        prompt_ids = await run_in_threadpool(lambda: [
            ctx.model.truncate(tok.encode(p, special) if isinstance(p, str) else list(p), body.truncate_prompt_tokens,
                               reserve=0) for p in inputs])
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        checked = [_check(ctx, ids, params) for ids in prompt_ids]
    except BaseException as e:
        return failed_before_engine(places, e)
    texts = [p if isinstance(p, str) else None for p in inputs]
    try:
        outputs = await ctx.engine.embed_all(request, checked, texts, places)
    except EngineDeadError:
        return error_response(internal_error(request_id_of(request)))
    if any(not isinstance(out, EmbeddingRequestOutput) for out in outputs):
        return error_response(APIError(503, "the request was aborted (the server is shutting down)",
                                       "server_error", code="aborted"))
    tokens = sum(len(ids) for ids in prompt_ids)
    return JSONResponse({
        "id": ctx.response_id(request, body, "embd"), "object": "list",
        "created": int(time.time()), "model": ctx.model.name,
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, body.encoding_format)}
                 for i, out in enumerate(outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _check(ctx: ServingContext, ids: list[int], params: PoolingParams) -> CheckedPooling:
    """The context length in OpenAI's words, then the engine's check (the one check: the engine queues what
    it returns as it is)."""
    limit = ctx.model.max_model_len
    if len(ids) > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{len(ids)} tokens in the input for embedding generation. Please reduce the length "
                            f"of the input (or set truncate_prompt_tokens).", param="input",
                       code="context_length_exceeded")
    return ctx.engine.check_pooling(ids, params, prompt_param="input")


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # the bytes of little-endian float32s, as OpenAI sends them
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector

