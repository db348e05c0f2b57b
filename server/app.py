"""OpenAI-compatible HTTP API over the async engine (Starlette + uvicorn).

1. A handler parses and validates the body (pydantic), resolves the model name, renders the chat
   template, tokenizes and checks the context length — every failure a 4xx in OpenAI's error shape,
   before anything is queued.
2. It submits one engine request per prompt and either streams SSE chunks as text becomes final or
   collects the results. A watcher aborts the requests as soon as the client disconnects.
3. `/health` is 503 until warm-up has compiled every program; `/metrics` is Prometheus text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from typing import AsyncIterator

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxserve.async_engine import AsyncEngine, EngineDeadError, TokenTimer
from jaxserve.engine import RequestOutput
from jaxserve.engine_args import EngineArgs
from jaxserve.sampling import InvalidParameter
from server.metrics import Metrics
from server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from sharding import multihost

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, type_, param, code)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body, status_code=e.status)


class OpenAIServer:
    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine
        self.metrics = Metrics(async_engine)
        self.created = int(time.time())

    # ---- helpers ----------------------------------------------------------------------------------

    @property
    def engine(self):
        return self.async_engine.engine

    def _require_ready(self) -> None:
        if self.async_engine.error:
            raise APIError(503, f"engine failed: {self.async_engine.error}", "server_error")
        if not self.async_engine.ready.is_set():
            raise APIError(503, "the model is still loading and compiling; retry shortly", "server_error",
                           code="model_not_ready")

    async def _parse(self, request: Request, schema):
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "request body is not valid JSON") from None
        if not isinstance(raw, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            body = schema.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param) from None
        if body.model is not None and body.model != self.engine.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"`{self.engine.model_name}`", param="model", code="model_not_found")
        return body

    def _check_and_build(self, body, prompt_ids: list[list[int]]):
        """Context-length checks and SamplingParams per prompt; raises APIError before any submission."""
        limit = self.engine.scheduler_config.max_model_len
        params = []
        for ids in prompt_ids:
            if not ids:
                raise APIError(400, "prompt is empty", param="prompt")
            max_tokens = body.max_tokens if body.max_tokens is not None else limit - len(ids)
            if len(ids) + max_tokens > limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, "
                                    f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                               param="max_tokens" if len(ids) < limit else "prompt",
                               code="context_length_exceeded")
            try:
                p = body.sampling_params(max_tokens)
                self.engine.validate(ids, p)
            except InvalidParameter as e:
                raise APIError(400, str(e), param=e.param) from None
            params.append(p)
        return params

    async def _results(self, request: Request, prompt_ids, params, texts) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run all prompts concurrently; yield (choice index, output) as outputs arrive. Aborts on disconnect."""
        base = uuid.uuid4().hex
        request_ids = [f"{base}-{i}" for i in range(len(prompt_ids))]
        merged: asyncio.Queue = asyncio.Queue()
        timers = [TokenTimer() for _ in prompt_ids]
        for ids in prompt_ids:
            self.metrics.prompt_tokens.inc(len(ids))

        def account(i: int, out: RequestOutput) -> None:
            timers[i].on_tokens(len(out.new_token_ids))
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self.metrics.observe_request(timers[i], out.finish_reason)

        async def watch_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for rid in request_ids:
                self.async_engine.abort(rid)

        watcher = asyncio.create_task(watch_disconnect())
        if len(prompt_ids) == 1:  # the common case: no fan-in, one task and one queue less per token
            try:
                async for out in self.async_engine.generate(prompt_ids[0], params[0], request_ids[0], texts[0]):
                    account(0, out)
                    yield 0, out
            finally:
                watcher.cancel()
            return

        async def pump(i: int):
            try:
                async for out in self.async_engine.generate(prompt_ids[i], params[i], request_ids[i], texts[i]):
                    account(i, out)
                    await merged.put((i, out))
            except Exception as e:  # surfaced to the handler through the queue
                await merged.put((i, e))

        pumps = [asyncio.create_task(pump(i)) for i in range(len(prompt_ids))]
        remaining = len(pumps)
        try:
            while remaining:
                i, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            watcher.cancel()
            for task in pumps:
                task.cancel()

    # ---- routes -----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            self._require_ready()
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self._require_ready()
        except APIError as e:
            return _error_response(e)
        engine = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": self.created, "owned_by": "jaxserve",
            "max_model_len": engine.scheduler_config.max_model_len,
            "root": engine.args.model or "built-in demo model (random weights, byte-level tokenizer)",
        }]})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        try:
            self._require_ready()
            body = await self._parse(request, CompletionRequest)
            tok = self.engine.tokenizer
            prompts = body.prompts()
            prompt_ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
            params = self._check_and_build(body, prompt_ids)
        except APIError as e:
            return _error_response(e)
        texts = [p if isinstance(p, str) else None for p in prompts]
        cid = f"cmpl-{uuid.uuid4().hex}"
        envelope = {"id": cid, "object": "text_completion", "created": int(time.time()),
                    "model": self.engine.model_name}
        results = self._results(request, prompt_ids, params, texts)
        usage = _Usage(prompt_ids)
        if body.stream:
            async def events():
                async for i, out in results:
                    usage.add(i, out)
                    if out.new_text or out.finished:
                        yield _sse({**envelope, "choices": [{"index": i, "text": out.new_text, "logprobs": None,
                                                             "finish_reason": out.finish_reason}]})
                if body.include_usage:
                    yield _sse({**envelope, "choices": [], "usage": usage.as_dict()})
                yield "data: [DONE]\n\n"
            return _event_stream(events())
        try:
            finals = {}
            async for i, out in results:
                usage.add(i, out)
                if out.finished:
                    finals[i] = out.outputs[0]
        except EngineDeadError as e:
            return _error_response(APIError(500, str(e), "server_error"))
        choices = [{"index": i, "text": finals[i].text, "logprobs": None, "finish_reason": finals[i].finish_reason}
                   for i in sorted(finals)]
        return JSONResponse({**envelope, "choices": choices, "usage": usage.as_dict()})

    async def chat_completions(self, request: Request) -> Response:
        try:
            self._require_ready()
            body = await self._parse(request, ChatCompletionRequest)
            tok = self.engine.tokenizer
            extra = {"tools": body.tools} if body.tools else {}
            try:
                text = tok.apply_chat_template([m.for_template() for m in body.messages],
                                               add_generation_prompt=body.add_generation_prompt,
                                               chat_template=body.chat_template, **extra)
            except ValueError as e:
                raise APIError(400, f"chat template: {e}", param="messages") from None
            # The template writes any BOS itself; encode must not add a second one.
            prompt_ids = [tok.encode(text, add_special_tokens=False)]
            params = self._check_and_build(body, prompt_ids)
        except APIError as e:
            return _error_response(e)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        envelope = {"id": cid, "created": int(time.time()), "model": self.engine.model_name}
        results = self._results(request, prompt_ids, params, [text])
        usage = _Usage(prompt_ids)
        if body.stream:
            chunk = {**envelope, "object": "chat.completion.chunk"}

            async def events():
                yield _sse({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
                async for i, out in results:
                    usage.add(i, out)
                    if out.new_text:
                        yield _sse({**chunk, "choices": [{"index": 0, "delta": {"content": out.new_text},
                                                          "logprobs": None, "finish_reason": None}]})
                    if out.finished:
                        yield _sse({**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                                          "finish_reason": out.finish_reason}]})
                if body.include_usage:
                    yield _sse({**chunk, "choices": [], "usage": usage.as_dict()})
                yield "data: [DONE]\n\n"
            return _event_stream(events())
        final = None
        try:
            async for i, out in results:
                usage.add(i, out)
                if out.finished:
                    final = out.outputs[0]
        except EngineDeadError as e:
            return _error_response(APIError(500, str(e), "server_error"))
        return JSONResponse({**envelope, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": final.text},
            "logprobs": None, "finish_reason": final.finish_reason}], "usage": usage.as_dict()})


class _Usage:
    def __init__(self, prompt_ids: list[list[int]]):
        self.prompt_tokens = sum(len(p) for p in prompt_ids)
        self.completion = [0] * len(prompt_ids)
        self.cached = [0] * len(prompt_ids)

    def add(self, index: int, out: RequestOutput) -> None:
        self.completion[index] = out.num_output_tokens
        self.cached[index] = out.num_cached_tokens

    def as_dict(self) -> dict:
        done = sum(self.completion)
        # prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache (OpenAI's field).
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached)}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    async def guarded():
        try:
            async for event in events:
                yield event
        except EngineDeadError as e:  # headers are gone: report in-band, as OpenAI streams do
            yield _sse(error_body(str(e), "server_error"))
            yield "data: [DONE]\n\n"
    return StreamingResponse(guarded(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_app(async_engine: AsyncEngine) -> Starlette:
    api = OpenAIServer(async_engine)

    async def not_found(request: Request, exc) -> Response:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", code="not_found"),
                            status_code=getattr(exc, "status_code", 404))

    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn re-raises SIGTERM/SIGINT once it has shut down, so code after uvicorn.run may never run:
        # stop the engine here, where a multi-host leader also releases its follower processes.
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        await asyncio.get_running_loop().run_in_executor(None, multihost.shutdown)

    app = Starlette(lifespan=lifespan, routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
    ], exception_handlers={404: not_found, 405: not_found, Exception: internal_error})
    app.state.api = api
    return app


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache, so a restart's warm-up loads programs instead of compiling."""
    if not directory:
        return
    import jax
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("persistent compilation cache: %s", path)


def serve(args: EngineArgs, host: str = "127.0.0.1", port: int = 8000,
          compilation_cache_dir: str | None = None) -> None:
    import uvicorn

    enable_compilation_cache(compilation_cache_dir)
    async_engine = AsyncEngine(args)
    async_engine.start()  # loads and compiles in the background; /health says 503 meanwhile
    app = build_app(async_engine)
    logger.info("serving on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions)", host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
