"""OpenAI-compatible HTTP API over the async engine (Starlette + uvicorn).

1. `guards.RequestGuard` has already checked the API key, the content type and the body size, and tagged
   the request with an id (see that module).
2. A handler admits the request against the queue limit (429 beyond it, 503 while shutting down), parses
   the body (JSON, valid UTF-8 strings, pydantic ranges), renders the chat template and tokenizes — both
   on a worker thread, so the event loop keeps answering — and checks the context length. Every failure
   is a 4xx in OpenAI's error shape, before anything is queued.
3. It submits one engine request per prompt and either streams SSE chunks as text becomes final or
   collects the results. A watcher aborts the requests as soon as the client disconnects; `abort_all`
   ends every running request with finish_reason "abort" (the end of the shutdown grace period).
4. An unexpected failure is a 500 that says "internal error" and the request id, never the exception's
   text, which goes to the log. `/health` is 503 until warm-up has compiled every program (and after
   the engine failed); `/metrics` is Prometheus text; `/openapi.json` describes the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
import time
import uuid
from typing import AsyncIterator

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.entrypoints.async_engine import AsyncEngine, EngineDeadError, TokenTimer
from jaxserve.outputs import RequestOutput
from jaxserve import __version__
from jaxserve.builtin_models import describe as describe_model
from jaxserve.lora.adapter import LoRAError
from jaxserve.sampling.params import InvalidParameter, SamplingParams
from jaxserve.scheduling.validation import CheckedRequest
from jaxserve.text.chat_template import ChatTemplateError
from server import playground
from server.http.guards import RequestGuard
from server.serving.metrics import Metrics
from server.openapi import openapi_document
from server.options import ServerOptions
from server.openai.protocol import ChatCompletionRequest
from server.openai.chat import chat_route
from server.openai.adapters import lora_routes
from server.openai.output_json import model_card
from server.openai.completions import completions_route
from server.openai.embeddings import embeddings_route, runner_route
from server.http.errors import (APIError, check_strings, error_body, error_response, internal_error, request_id_of,
                                validation_error)
from server.replies.reasoning import ReasoningParser
from server.responses.store import ResponseStore
from server.responses.routes import delete_response_route, get_response_route, responses_route
from server.openai.tokenize import DetokenizeRequest, TokenizeRequest

logger = logging.getLogger(__name__)


class OpenAIServer:
    def __init__(self, async_engine: AsyncEngine, options: ServerOptions = ServerOptions()):
        self.async_engine = async_engine
        self.options = options
        self.metrics = Metrics(async_engine)
        self.created = int(time.time())
        self.in_flight = 0  # engine requests this server has submitted (or is about to) and not seen finish
        self.draining = False  # shutting down: no new requests
        self._live: set[str] = set()  # ids of the engine requests now running, for abort_all
        # Characters a text prompt may have before tokenizing it is pointless (see prompt_fits).
        self.max_prompt_chars: int | None = None
        self.reasoning = ReasoningParser(options.reasoning_parser) if options.reasoning_parser else None
        self.stored_responses = ResponseStore(options.responses_store_size)
        # --seed: where requests without a seed get theirs (thread-safe: settings are built on worker threads).
        self._seeds = random.Random(options.seed) if options.seed is not None else None

    # ---- helpers ----------------------------------------------------------------------------------

    @property
    def engine(self):
        return self.async_engine.engine

    def require_ready(self) -> None:
        if self.async_engine.error:
            raise APIError(503, "the engine failed; the server is restarting", "server_error",
                           code="engine_failed")
        if not self.async_engine.ready.is_set():
            raise APIError(503, "the model is still loading and compiling; retry shortly", "server_error",
                           code="model_not_ready")
        if self.draining:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")

    def admit(self, n: int) -> None:
        """Count n new engine requests against the queue limit (a prompt list counts each prompt)."""
        limit = self.options.max_queued_requests
        if limit is not None and self.in_flight + n > self.engine.scheduler_config.max_num_seqs + limit:
            raise APIError(429, f"the server is at capacity ({self.in_flight} requests running or queued); "
                                f"retry later", "rate_limit_error", code="too_many_requests",
                           headers={"Retry-After": "1"})
        self.in_flight += n

    def fail_before_engine(self, admitted: int, error: BaseException) -> Response:
        """A request failed before it reached the engine: give back its `admitted` queue places. An APIError
        becomes its error response; anything else propagates."""
        self.in_flight -= admitted
        if isinstance(error, APIError):
            return error_response(error)
        raise error

    async def parse(self, request: Request, schema):
        raw = await request.body()  # already bounded by the guard
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
            raise validation_error(e) from None
        except RecursionError:
            raise APIError(400, "request body is nested too deeply") from None
        if body.unknown_fields:
            logger.warning("request %s: ignored unknown fields %s", request_id_of(request), body.unknown_fields)
        self.lora_for(body.model)  # a 404 for a model this server does not serve
        return body

    def lora_for(self, model: str | None):
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for anything else."""
        engine = self.engine
        if model is None or model == engine.model_name:
            return None
        lora = engine.lora.lookup(model) if engine.lora is not None else None
        if lora is None:
            adapters = [r.lora_name for r in engine.lora.names()] if engine.lora is not None else []
            served = ", ".join(f"`{name}`" for name in [engine.model_name, *adapters])
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return lora

    def served_name(self, model: str | None) -> str:
        """The `model` a reply names: the adapter the request chose, else the base model."""
        lora = self.lora_for(model)
        return self.engine.model_name if lora is None else lora.lora_name

    def prompt_fits(self, text: str, param: str = "prompt") -> None:
        """Refuse, without tokenizing, a text that cannot fit the context: every token covers at most the
        vocabulary's longest token string, so the text has at least len(text) / that many tokens."""
        limit = self.engine.scheduler_config.max_model_len
        if self.max_prompt_chars is None:
            self.max_prompt_chars = limit * self.engine.tokenizer.max_token_chars
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the {param} has "
                                f"{len(text)} characters, more than that many tokens can hold",
                           param=param, code="context_length_exceeded")

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the context allows)."""
        if keep is None:
            return ids
        keep = self.engine.scheduler_config.max_model_len - 1 if keep == -1 else keep
        return ids[-keep:] if keep else ids

    def check_and_build(self, body, prompt_ids: list[list[int]], max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, reasoning_end: str | None = None) -> list[CheckedRequest]:
        """Context-length checks, SamplingParams per prompt and the engine's check of each (the one check: the
        engine queues what it returns as it is); raises APIError before any submission.
        `max_tokens` None: the model's default (generation_config), else up to the context length.
        `reasoning_end`: the reply thinks first, and an output constraint applies after this text."""
        limit = self.engine.scheduler_config.max_model_len
        lora = self.lora_for(body.model)
        checked = []
        for ids in prompt_ids:
            wanted = max_tokens if max_tokens is not None else self.options.sampling_defaults.get("max_tokens")
            wanted = wanted if wanted is not None else limit - len(ids)
            if len(ids) + wanted > limit:
                if max_tokens is None and len(ids) < limit:  # a default, not the client's: it shrinks to fit
                    wanted = limit - len(ids)
                else:
                    raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                                        f"you requested {len(ids) + wanted} tokens ({len(ids)} in the prompt, "
                                        f"{wanted} for the completion). Reduce the prompt or max_tokens.",
                                   param="max_tokens" if len(ids) < limit else "prompt",
                                   code="context_length_exceeded")
            try:
                p = body.to_sampling_params(wanted, logprobs, self.options.sampling_defaults)
                if prompt_logprobs is not None and p.prompt_logprobs is None:
                    p = dataclasses.replace(p, prompt_logprobs=prompt_logprobs)
                if reasoning_end is not None and p.structured_outputs is not None:
                    p = dataclasses.replace(p, structured_outputs=dataclasses.replace(
                        p.structured_outputs, reasoning_end=reasoning_end))
                checked.append(self.engine.check_request(ids, self.seeded(p), body.priority, lora))
            except InvalidParameter as e:
                raise APIError(400, str(e), param=e.param) from None
            except LoRAError as e:  # the adapter's files, read now, cannot be served
                raise APIError(400, str(e), param="model", code="invalid_lora_adapter") from None
        return checked

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """A request without a seed gets the next one of the server's --seed sequence (unchanged without it)."""
        if self._seeds is None or params.seed is not None or params.temperature == 0:
            return params
        return dataclasses.replace(params, seed=self._seeds.getrandbits(63))

    def render_chat(self, body: ChatCompletionRequest) -> str:
        """The chat prompt (worker thread): the request's template only if trusted, else the server's
        (--chat-template), else the model's. With continue_final_message the prompt ends right after the
        final (assistant) message's text, so the reply continues it."""
        if body.chat_template is not None and not self.options.trust_request_chat_template:
            raise APIError(400, "request chat templates are disabled on this server (start it with "
                                "--trust-request-chat-template to allow them)", param="chat_template")
        template = body.chat_template or self.options.chat_template
        messages = [m.for_template() for m in body.messages]
        try:
            text = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, chat_template=template,
                time_limit=self.options.chat_template_timeout, **body.template_variables())
        except ChatTemplateError as e:
            raise APIError(400, f"chat template: {e}", param="messages", code="chat_template_error") from None
        except ValueError as e:  # no template at all
            raise APIError(400, f"chat template: {e}; start the server with --chat-template",
                           param="messages") from None
        if body.continue_final_message:
            final = body.messages[-1].text
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise APIError(400, "continue_final_message: the chat template does not write the final "
                                    "message's text as it is", param="continue_final_message")
            text = text[:cut + len(final)]
        return text

    def chosen_id(self, request: Request) -> str | None:
        """The request's X-Request-Id when --enable-request-id-headers makes it the request's id."""
        return request.scope.get("state", {}).get("client_request_id") if self.options.enable_request_id_headers \
            else None

    def response_id(self, request: Request, body, prefix: str) -> str:
        """The response's `id`: vLLM's prefix (cmpl, chatcmpl) and the id the client chose (`chosen_id`),
        else the body's `request_id`, else a fresh one."""
        return f"{prefix}-{self.chosen_id(request) or body.request_id or uuid.uuid4().hex}"

    async def results(self, request: Request, checked: list[CheckedRequest], texts,
                      response_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run all prompts concurrently; yield (prompt index, output) as outputs arrive (each output names its
        choice). Aborts on disconnect. The caller has admitted every choice of every prompt; they are
        released here when this generator ends. The engine ids are fresh, or — when the client chose the
        response's id (--enable-request-id-headers) — start with it, so the logs carry it, followed by a
        random part as vLLM adds one: the engine keys its state by id, and two requests may carry the same."""
        base = f"{response_id}-{uuid.uuid4().hex[:8]}" if self.chosen_id(request) else uuid.uuid4().hex
        request_ids = [f"{base}-{i}" for i in range(len(checked))]
        merged: asyncio.Queue = asyncio.Queue()
        timers = [TokenTimer() for _ in checked]
        for c in checked:
            self.metrics.prompt_tokens.inc(len(c.prompt_ids))
        self._live.update(request_ids)

        def account(i: int, out: RequestOutput) -> None:
            timers[i].on_tokens(len(out.new_token_ids))
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                self.metrics.observe_request(timers[i], out)

        watcher = self.abort_on_disconnect(request, request_ids)
        pumps: list[asyncio.Task] = []
        try:
            if len(checked) == 1:  # the common case: no fan-in, one task and one queue less per token
                async for out in self.async_engine.generate(checked[0], request_ids[0], texts[0]):
                    account(0, out)
                    yield 0, out
                return

            async def pump(i: int):
                try:
                    async for out in self.async_engine.generate(checked[i], request_ids[i], texts[i]):
                        account(i, out)
                        await merged.put((i, out))
                except Exception as e:  # surfaced to the handler through the queue
                    await merged.put((i, e))

            pumps = [asyncio.create_task(pump(i)) for i in range(len(checked))]
            remaining = sum(c.params.n for c in checked)  # every choice of every prompt finishes once
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
            self._live.difference_update(request_ids)
            self.in_flight -= sum(c.params.n for c in checked)

    def abort_on_disconnect(self, request: Request, request_ids: list[str]) -> asyncio.Task:
        """A task that aborts the engine requests once the client goes away (cancel it when they are done)."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for rid in request_ids:
                self.async_engine.abort(rid)
        return asyncio.create_task(watch())

    def abort_all(self) -> int:
        """End every running request now (finish_reason "abort"); returns how many."""
        for rid in list(self._live):
            self.async_engine.abort(rid)
        return len(self._live)

    # ---- routes -----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            self.require_ready()
        except APIError as e:
            return error_response(e)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        try:
            self.require_ready()
        except APIError as e:
            return error_response(e)
        engine = self.engine
        root = engine.args.model_dir or describe_model(engine.args.model)
        limit = engine.scheduler_config.max_model_len
        adapters = engine.lora.names() if engine.lora is not None else []
        return JSONResponse({"object": "list", "data": [
            model_card(engine.model_name, self.created, root, limit),
            *(model_card(r.lora_name, self.created, r.lora_path, limit, parent=engine.model_name)
              for r in adapters)]})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document(self.options.root_path))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt or chat messages -> token ids (and their texts)."""
        try:
            self.require_ready()
            body = await self.parse(request, TokenizeRequest)
            tok = self.engine.tokenizer
            if body.messages is not None:
                chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
                text = await run_in_threadpool(self.render_chat, chat)
                add_special = body.add_special_tokens if body.add_special_tokens is not None else False
            else:
                text, add_special = body.prompt, body.add_special_tokens is not False
            self.prompt_fits(text)
            ids = await run_in_threadpool(tok.encode, text, add_special)
        except APIError as e:
            return error_response(e)
        reply = {"count": len(ids), "max_model_len": self.engine.scheduler_config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            reply["token_strs"] = [tok.token_str(t) for t in ids]
        return JSONResponse(reply)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: token ids -> text."""
        try:
            self.require_ready()
            body = await self.parse(request, DetokenizeRequest)
            vocab = self.engine.model_config.vocab_size
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
            text = await run_in_threadpool(self.engine.tokenizer.decode, body.tokens, False)
        except APIError as e:
            return error_response(e)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})


def build_app(async_engine: AsyncEngine, options: ServerOptions = ServerOptions()) -> Starlette:
    api = OpenAIServer(async_engine, options)

    async def not_found(request: Request, exc) -> Response:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", code="not_found"),
                            status_code=getattr(exc, "status_code", 404))

    async def unhandled(request: Request, exc: Exception) -> Response:
        request_id = request_id_of(request)
        logger.exception("unhandled error on %s (request id %s)", request.url.path, request_id)
        return error_response(internal_error(request_id))

    middleware = [Middleware(RequestGuard, api_key=options.api_key, max_body_bytes=options.max_request_body_bytes,
                             request_id_headers=options.enable_request_id_headers)]
    if options.allowed_origins:  # outermost, so preflights are answered before authentication
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                                        allow_methods=["GET", "POST", "OPTIONS"],
                                        allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                                        expose_headers=["X-Request-Id"]))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Stop the engine with the app (multi-host: the other processes are released and all leave together).
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    def generating(handler, api_name: str):
        return runner_route(api, "generate", api_name, functools.partial(handler, api))

    app = Starlette(lifespan=lifespan, middleware=middleware, routes=[
        Route("/health", api.health, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/metrics", api.metrics_route, methods=["GET"]),
        Route("/openapi.json", api.openapi, methods=["GET"]),
        Route("/v1/completions", generating(completions_route, "Completions API"), methods=["POST"]),
        Route("/v1/chat/completions", generating(chat_route, "Chat Completions API"), methods=["POST"]),
        Route("/v1/responses", generating(responses_route, "Responses API"), methods=["POST"]),
        Route("/v1/embeddings", runner_route(api, "pooling", "Embeddings API",
                                             functools.partial(embeddings_route, api)), methods=["POST"]),
        Route("/v1/responses/{response_id}", functools.partial(get_response_route, api), methods=["GET"]),
        Route("/v1/responses/{response_id}", functools.partial(delete_response_route, api), methods=["DELETE"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/version", api.version, methods=["GET"]),
        *lora_routes(api),
        *playground.routes(),
    ], exception_handlers={404: not_found, 405: not_found, Exception: unhandled})
    app.state.api = api
    return app
