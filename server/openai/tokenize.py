"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt, or chat messages rendered by the chat template,
to token ids (and their texts); token ids to text. Both tokenize on a worker thread, as the generating
routes do, and count against no queue: nothing reaches the engine.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.http.bodies import RequestBody
from server.http.errors import APIError, UnsupportedField, error_response
from server.openai.prompts import render_chat
from server.openai.protocol import ChatCompletionRequest, ChatMessage
from server.serving.context import ServingContext


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedField("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def tokenize_route(ctx: ServingContext, request: Request) -> Response:
    try:
        ctx.require_ready()
        body = await ctx.parse(request, TokenizeRequest)
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
            text = await run_in_threadpool(render_chat, ctx, chat)
            add_special = body.add_special_tokens if body.add_special_tokens is not None else False
        else:
            text, add_special = body.prompt, body.add_special_tokens is not False
        ctx.model.prompt_fits(text)
        ids = await run_in_threadpool(ctx.model.tokenizer.encode, text, add_special)
    except APIError as e:
        return error_response(e)
    reply = {"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [ctx.model.tokenizer.token_str(t) for t in ids]
    return JSONResponse(reply)


async def detokenize_route(ctx: ServingContext, request: Request) -> Response:
    try:
        ctx.require_ready()
        body = await ctx.parse(request, DetokenizeRequest)
        vocab = ctx.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
        text = await run_in_threadpool(ctx.model.tokenizer.decode, body.tokens, False)
    except APIError as e:
        return error_response(e)
    return JSONResponse({"prompt": text})
