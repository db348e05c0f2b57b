"""The app: the OpenAI-compatible routes over the async engine (Starlette), assembled from the rooms below.

1. `http/guards.RequestGuard` has already checked the API key, the content type and the body size, and
   tagged the request with an id (see that module); CORS, when --allowed-origins asks for it, sits outside.
2. `build_app` makes the serving context (server/serving/context.py) and hands it to every handler: the
   OpenAI endpoints (server/openai/), the Responses API (server/responses/, with its store), vLLM's LoRA
   routes. A handler admits the request against the queue limit (429 beyond it, 503 while shutting down),
   reads its body (JSON, valid UTF-8 strings, pydantic ranges), renders the chat template and tokenizes
   on a worker thread, and has the engine check each prompt once; every failure is a 4xx in OpenAI's
   error shape, before anything is queued. It then streams SSE chunks as text becomes final or collects
   the results; a client that disconnects has its requests aborted.
3. A route for the other runner (completions on a pooling server, embeddings on a generating one) is a 400
   naming the runner that serves it.
4. An unexpected failure is a 500 that says "internal error" and the request id, never the exception's
   text, which goes to the log; an unknown path is a 404 in the same shape. `/health` is 503 until warm-up
   has compiled every program (and after the engine failed); `/metrics` is Prometheus text;
   `/openapi.json` describes the routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxserve.entrypoints.async_engine import AsyncEngine
from server.http.errors import APIError, error_body, error_response, internal_error, request_id_of
from server.http.guards import RequestGuard
from server.openai.adapters import lora_routes
from server.openai.chat import chat_route
from server.openai.completions import completions_route
from server.openai.embeddings import embeddings_route
from server.openai.models import models_route, version_route
from server.openai.tokenize import detokenize_route, tokenize_route
from server.openapi import openapi_document
from server.options import ServerOptions
from server.playground import routes as playground_routes
from server.responses.routes import delete_response_route, get_response_route, responses_route
from server.responses.store import ResponseStore
from server.serving.context import ServingContext

logger = logging.getLogger(__name__)


def build_app(async_engine: AsyncEngine, options: ServerOptions = ServerOptions()) -> Starlette:
    ctx = ServingContext.start(async_engine, options)
    store = ResponseStore(options.responses_store_size)  # the Responses API's: only its routes see it

    async def health(request: Request) -> Response:
        try:
            ctx.require_ready()
        except APIError as e:
            return error_response(e)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(options.root_path))

    def on(runner: str, api_name: str, handler, *state):
        """`handler`, given the context (and `state`), where the engine runs with `runner`."""
        return _for_runner(ctx, runner, api_name, functools.partial(handler, ctx, *state))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/v1/models", functools.partial(models_route, ctx), methods=["GET"]),
        Route("/v1/completions", on("generate", "Completions API", completions_route), methods=["POST"]),
        Route("/v1/chat/completions", on("generate", "Chat Completions API", chat_route), methods=["POST"]),
        Route("/v1/responses", on("generate", "Responses API", responses_route, store), methods=["POST"]),
        Route("/v1/responses/{response_id}", functools.partial(get_response_route, store), methods=["GET"]),
        Route("/v1/responses/{response_id}", functools.partial(delete_response_route, store), methods=["DELETE"]),
        Route("/v1/embeddings", on("pooling", "Embeddings API", embeddings_route), methods=["POST"]),
        Route("/tokenize", functools.partial(tokenize_route, ctx), methods=["POST"]),
        Route("/detokenize", functools.partial(detokenize_route, ctx), methods=["POST"]),
        *lora_routes(ctx),
        *playground_routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # Stop the engine with the app (multi-host: the other processes are released and all leave together).
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = Starlette(lifespan=lifespan, middleware=_middleware(options), routes=routes,
                    exception_handlers={404: _not_found, 405: _not_found, Exception: _unhandled})
    app.state.context = ctx  # for `serve` (draining, abort_all) and for tests that look inside
    return app


def _middleware(options: ServerOptions) -> list[Middleware]:
    middleware = [Middleware(RequestGuard, api_key=options.api_key, max_body_bytes=options.max_request_body_bytes,
                             request_id_headers=options.enable_request_id_headers)]
    if options.allowed_origins:  # outermost, so preflights are answered before authentication
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                                        allow_methods=["GET", "POST", "OPTIONS"],
                                        allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                                        expose_headers=["X-Request-Id"]))
    return middleware


def _for_runner(ctx: ServingContext, runner: str, api_name: str, handler):
    """`handler` where the engine runs with `runner`; elsewhere a 400 that says which runner serves it (a
    generate-runner server has no embeddings, a pooling one no completions, as in vLLM)."""
    async def route(request: Request) -> Response:
        served = ctx.model.runner
        if served is not None and served != runner:  # before the engine is built: the handler's 503
            return error_response(APIError(
                400, f"The model does not support the {api_name}: this server runs it with --runner {served}; "
                     f"start it with --runner {runner} for the {api_name}", code="unsupported_api"))
        return await handler(request)
    return route


async def _not_found(request: Request, exc) -> Response:
    return JSONResponse(error_body(f"no route {request.method} {request.url.path}", code="not_found"),
                        status_code=getattr(exc, "status_code", 404))


async def _unhandled(request: Request, exc: Exception) -> Response:
    request_id = request_id_of(request)
    logger.exception("unhandled error on %s (request id %s)", request.url.path, request_id)
    return error_response(internal_error(request_id))
