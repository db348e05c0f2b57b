"""`POST /v1/embeddings`: OpenAI's embeddings API over the pooling runner (`--runner pooling`).

1. The body (`EmbeddingRequest`) takes `input` as a string, a list of strings, a list of token ids or a
   list of those, or (vLLM's chat-style request) `messages`, rendered by the chat template as for chat;
   `encoding_format` float or base64 (little-endian float32, what the `openai` client asks for by
   default); `dimensions` only where the model is Matryoshka (else a 400 naming it); vLLM's
   `truncate_prompt_tokens`, `add_special_tokens` and `normalize`. Other vLLM fields are refused by name.
2. Every input is admitted against the queue limit, tokenized on a worker thread and checked by the
   engine (`Engine.check_pooling`, the one check) before any is queued; then all run at once, batched by the engine
   with whatever else is running, and the answer lists them in input order with the prompt tokens as
   usage. A client that disconnects aborts what is left.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.engine.pooling_requests import CheckedPooling
from jaxserve.entrypoints.async_engine import EngineDeadError, TokenTimer
from jaxserve.errors import InvalidParameter
from jaxserve.pooling.params import EmbeddingRequestOutput, PoolingParams
from server.http.errors import (APIError, UnsupportedField, error_response, internal_error, request_id_of,
                                validation_error)
from server.openai.protocol import MAX_PROMPTS, ChatCompletionRequest, ChatMessage

# vLLM fields of its embedding request that this server refuses unless they keep their default.
_UNSUPPORTED = {
    "priority": (0, "priority scheduling is not enabled"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "embed_dtype": ("float32", "embed_dtype other than float32 is not supported"),
    "use_activation": (None, "use_activation is not supported by embedding models; use normalize"),
}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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


async def embeddings_route(api, request: Request) -> Response:
    admitted = 0
    try:
        api.require_ready()
        body: EmbeddingRequest = await api.parse(request, EmbeddingRequest)
        inputs = [await run_in_threadpool(api.render_chat, body.as_chat())] if body.messages else body.inputs()
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        api.admit(len(inputs))
        admitted = len(inputs)
        for item in inputs:
            if isinstance(item, str) and body.truncate_prompt_tokens is None:  # too long to be worth tokenizing
                api.prompt_fits(item, "input")
        tok = api.engine.tokenizer
        prompt_ids = await run_in_threadpool(lambda: [
            _truncate(api, tok.encode(p, special) if isinstance(p, str) else list(p),
                      body.truncate_prompt_tokens) for p in inputs])
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
        checked = [_check(api, ids, params) for ids in prompt_ids]
    except BaseException as e:
        return api.fail_before_engine(admitted, e)
    texts = [p if isinstance(p, str) else None for p in inputs]
    try:
        outputs = await _run_all(api, request, checked, texts)
    except EngineDeadError:
        return error_response(internal_error(request_id_of(request)))
    finally:
        api.in_flight -= admitted
    if any(not isinstance(out, EmbeddingRequestOutput) for out in outputs):
        return error_response(APIError(503, "the request was aborted (the server is shutting down)",
                                       "server_error", code="aborted"))
    tokens = sum(len(ids) for ids in prompt_ids)
    return JSONResponse({
        "id": api.response_id(request, body, "embd"), "object": "list",
        "created": int(time.time()), "model": api.engine.model_name,
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, body.encoding_format)}
                 for i, out in enumerate(outputs)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _truncate(api, ids: list[int], keep: int | None) -> list[int]:
    """truncate_prompt_tokens: the last `keep` tokens (-1: as many as the context holds)."""
    if keep == -1:
        return ids[-api.engine.scheduler_config.max_model_len:]
    return ids[-keep:] if keep else ids


def _check(api, ids: list[int], params: PoolingParams) -> CheckedPooling:
    """The engine's check of one input (the one check: the engine queues what it returns as it is)."""
    limit = api.engine.scheduler_config.max_model_len
    if len(ids) > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{len(ids)} tokens in the input for embedding generation. Please reduce the length "
                            f"of the input (or set truncate_prompt_tokens).", param="input",
                       code="context_length_exceeded")
    try:
        return api.engine.check_pooling(ids, params)
    except InvalidParameter as e:
        raise APIError(400, str(e), param="input" if e.param == "prompt" else e.param) from None


async def _run_all(api, request: Request, checked: list[CheckedPooling], texts: list[str | None]) -> list:
    """Every input at once (the engine batches them); aborts what is left when the client goes away."""
    request_ids = [f"embd-{uuid.uuid4().hex}-{i}" for i in range(len(checked))]
    for c in checked:
        api.metrics.prompt_tokens.inc(len(c.prompt_ids))
    api._live.update(request_ids)  # abort_all (the end of a shutdown's grace period) ends them too
    watcher = api.abort_on_disconnect(request, request_ids)

    async def one(c: CheckedPooling, rid: str, text: str | None):
        timer = TokenTimer()
        out = await api.async_engine.embed(c, rid, text)
        api.metrics.observe_request(timer, out)  # request count, end-to-end and queue time, prompt length
        return out

    try:
        return await asyncio.gather(*(one(c, rid, text) for c, rid, text in zip(checked, request_ids, texts)))
    finally:
        watcher.cancel()
        api._live.difference_update(request_ids)


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # the bytes of little-endian float32s, as OpenAI sends them
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def runner_route(api, runner: str, api_name: str, handler):
    """`handler` where the engine runs with `runner`; elsewhere a 400 that says which runner serves it (a
    generate-runner server has no embeddings, a pooling one no completions, as in vLLM)."""
    async def route(request: Request) -> Response:
        engine = api.engine
        if engine is not None and engine.runner_type != runner:  # before the engine is built: 503 from handler
            other = "generate" if runner == "pooling" else "pooling"
            return error_response(APIError(
                400, f"The model does not support the {api_name}: this server runs it with --runner {other}; "
                     f"start it with --runner {runner} for the {api_name}", code="unsupported_api"))
        return await handler(request)
    return route
