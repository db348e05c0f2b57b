"""The serving context: everything a request handler may use, each part with its own narrow interface.

1. `ServingContext.start(async_engine, options)` builds it once per app (server/app.py); every handler
   receives it as its first argument.
2. A handler asks `require_ready` (503 while loading, after an engine failure, while draining), reads its
   body with `parse` (the pydantic model, and a 404 for a `model` this server does not serve), takes its
   queue places from `admission`, prepares its prompts with `model` (tokenizer, chat template, limits,
   LoRA adapters) and `options`, has `engine` check them once and run them, and builds its reply.
3. The counters and histograms change only through `metrics`' methods, which the engine client calls;
   queue places and running requests only through `admission` and `engine`. No handler holds state of
   its own between requests, except the Responses API's store (server/responses/store.py), which only
   its routes see.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid

from starlette.requests import Request

from jaxserve.entrypoints.async_engine import AsyncEngine
from server.http.bodies import Body, read_body
from server.http.guards import client_request_id
from server.options import ServerOptions
from server.replies.reasoning import ReasoningParser
from server.serving.admission import Admission
from server.serving.engine_client import EngineClient
from server.serving.metrics import Metrics
from server.serving.model import ServedModel


@dataclasses.dataclass
class ServingContext:
    engine: EngineClient  # readiness; the one check of a prompt; running, streaming and aborting requests
    model: ServedModel  # name, limits, tokenizer and chat template, LoRA adapters
    admission: Admission  # the queue limit (429) and draining (503): places for engine requests
    metrics: Metrics  # Prometheus: counters and histograms, changed only through its methods
    options: ServerOptions
    reasoning: ReasoningParser | None  # --reasoning-parser: how a reply's thinking is split off
    # --seed: where requests without a seed get theirs (thread-safe: settings are built on worker threads).
    seeds: random.Random | None
    created: int  # when the server started (the `created` of /v1/models)

    @classmethod
    def start(cls, async_engine: AsyncEngine, options: ServerOptions) -> ServingContext:
        metrics = Metrics(async_engine)
        model = ServedModel(async_engine)
        return cls(engine=EngineClient(async_engine, metrics, ids_from_client=options.enable_request_id_headers),
                   model=model, admission=Admission(options.max_queued_requests, lambda: model.max_num_seqs),
                   metrics=metrics, options=options,
                   reasoning=ReasoningParser(options.reasoning_parser) if options.reasoning_parser else None,
                   seeds=random.Random(options.seed) if options.seed is not None else None,
                   created=int(time.time()))

    def require_ready(self) -> None:
        self.engine.require_ready()
        self.admission.check_open()

    async def parse(self, request: Request, schema: type[Body]) -> Body:
        """The request's body as `schema` (a 400 naming the field), for a model this server serves (404)."""
        body = await read_body(request, schema)
        self.model.adapter_for(body.model)
        return body

    def response_id(self, request: Request, body, prefix: str) -> str:
        """The response's `id`: vLLM's prefix (cmpl, chatcmpl, embd) and the id the client chose
        (X-Request-Id, with --enable-request-id-headers), else the body's `request_id`, else a fresh one."""
        chosen = client_request_id(request) if self.options.enable_request_id_headers else None
        return f"{prefix}-{chosen or body.request_id or uuid.uuid4().hex}"
