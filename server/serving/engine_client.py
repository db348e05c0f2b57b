"""The async engine as the handlers use it: whether it serves, the one check of a request, and the outputs of
what it runs.

1. `require_ready`: 503 while the model loads and compiles, and once the engine has failed.
2. `check` and `check_pooling` are the engine's check of one prompt (`Engine.check_request`,
   `Engine.pooling.check`: the limits that depend on the model and the engine's sizes; call them on a
   worker thread, since a new grammar compiles there and an adapter is read). What the engine refuses is a
   400 naming the parameter. Handlers check every prompt of a request before they run any, and the engine
   queues what passed as it is: each prompt is checked once.
3. `stream` runs a request's checked prompts at once and yields (prompt index, output) as outputs arrive;
   `embed_all` runs an embedding request's inputs and returns their outputs in order. Both count tokens
   and latencies into the metrics, abort the engine requests once the client goes away, and give the
   request's queue places back when they end (`if_never_read`: also when a streamed response ends before it
   read the stream at all, which then never started). The engine ids are fresh, or, when the client chose the
   response's id (--enable-request-id-headers), start with it, so the logs carry it, followed by a random
   part as vLLM adds one: the engine keys its state by id, and two requests may carry the same.
4. `abort_all` ends every running request (finish_reason "abort"): the end of a shutdown's grace period.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from typing import AsyncIterator, Callable, Sequence

from starlette.requests import Request

from jaxserve.engine.pooling_requests import CheckedPooling
from jaxserve.entrypoints.async_engine import AsyncEngine, TokenTimer
from jaxserve.errors import InvalidParameter
from jaxserve.lora.adapter import LoRAError
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.pooling.params import PoolingParams
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.validation import CheckedRequest
from server.http.errors import APIError
from server.http.guards import client_request_id
from server.serving.admission import Places
from server.serving.metrics import Metrics


class EngineClient:
    def __init__(self, async_engine: AsyncEngine, metrics: Metrics, ids_from_client: bool = False):
        self._async_engine = async_engine
        self._metrics = metrics
        self._ids_from_client = ids_from_client  # --enable-request-id-headers
        self._live: set[str] = set()  # ids of the engine requests now running, for abort_all

    def require_ready(self) -> None:
        if self._async_engine.error:
            raise APIError(503, "the engine failed; the server is restarting", "server_error",
                           code="engine_failed")
        if not self._async_engine.ready.is_set():
            raise APIError(503, "the model is still loading and compiling; retry shortly", "server_error",
                           code="model_not_ready")

    # ---- the one check --------------------------------------------------------------------------------

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0,
              lora: LoRARequest | None = None) -> CheckedRequest:
        try:
            return self._async_engine.engine.check_request(prompt_ids, params, priority, lora)
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param) from None
        except LoRAError as e:  # the adapter's files, read now, cannot be served
            raise APIError(400, str(e), param="model", code="invalid_lora_adapter") from None

    def require_images(self, images: Sequence) -> None:
        """Whether the engine runs the model's images at all (`engine/images.py`): raises InvalidParameter
        naming the first image's field where it does not (before anything is fetched)."""
        self._async_engine.engine.images.require(images)

    def attach_images(self, checked: CheckedRequest, images: Sequence) -> CheckedRequest:
        """A checked prompt with its images (`engine/images.py`); a 400 naming the image it cannot serve."""
        try:
            return self._async_engine.engine.images.attach(checked, images)
        except InvalidParameter as e:
            raise APIError(400, str(e), param=e.param, code="unsupported_parameter") from None

    def check_pooling(self, prompt_ids: Sequence[int], params: PoolingParams,
                      prompt_param: str = "input") -> CheckedPooling:
        """`prompt_param`: the request's name for its prompt, which the engine calls `prompt`."""
        try:
            return self._async_engine.engine.pooling.check(prompt_ids, params)
        except InvalidParameter as e:
            raise APIError(400, str(e), param=prompt_param if e.param == "prompt" else e.param) from None

    # ---- running ----------------------------------------------------------------------------------------

    async def stream(self, request: Request, checked: list[CheckedRequest], texts: list[str | None],
                     response_id: str, places: Places) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every prompt's outputs, as (prompt index, output); each output names its choice. `places` cover
        every choice of every prompt; they go back when this generator ends."""
        request_ids = self._engine_ids(request, response_id, len(checked))
        timers = [TokenTimer() for _ in checked]
        for c in checked:
            self._metrics.count_prompt(len(c.prompt_ids))
        self._live.update(request_ids)

        def account(i: int, out: RequestOutput) -> None:
            timers[i].on_tokens(len(out.new_token_ids))
            self._metrics.count_generated(len(out.new_token_ids))
            if out.finished:
                self._metrics.observe_request(timers[i], out)

        watcher = self._abort_on_disconnect(request, request_ids)
        pumps: list[asyncio.Task] = []
        try:
            if len(checked) == 1:  # the common case: no fan-in, one task and one queue less per token
                async for out in self._async_engine.generate(checked[0], request_ids[0], texts[0]):
                    account(0, out)
                    yield 0, out
                return
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int):
                try:
                    async for out in self._async_engine.generate(checked[i], request_ids[i], texts[i]):
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
            places.release()

    @staticmethod
    def if_never_read(results: AsyncIterator, places: Places) -> Callable[[], None]:
        """For a streamed response's end: `places` back if it never read `results` (the client went away
        before the first byte, and Starlette never started the body), whose own `finally` gives them back
        otherwise. Nothing was submitted to the engine then: `stream` submits on its first read."""
        def release() -> None:
            if inspect.getasyncgenstate(results) == inspect.AGEN_CREATED:
                places.release()
        return release

    async def embed_all(self, request: Request, checked: list[CheckedPooling], texts: list[str | None],
                        places: Places) -> list:
        """Every input at once (the engine batches them), outputs in input order; an aborted one is a
        `RequestOutput` with finish_reason "abort" instead of an embedding."""
        request_ids = [f"embd-{uuid.uuid4().hex}-{i}" for i in range(len(checked))]
        for c in checked:
            self._metrics.count_prompt(len(c.prompt_ids))
        self._live.update(request_ids)
        watcher = self._abort_on_disconnect(request, request_ids)

        async def one(c: CheckedPooling, request_id: str, text: str | None):
            timer = TokenTimer()
            out = await self._async_engine.embed(c, request_id, text)
            self._metrics.observe_request(timer, out)  # request count, end-to-end and queue time, prompt length
            return out

        try:
            return await asyncio.gather(*(one(c, rid, text) for c, rid, text in zip(checked, request_ids, texts)))
        finally:
            watcher.cancel()
            self._live.difference_update(request_ids)
            places.release()

    def abort_all(self) -> int:
        """End every running request now (finish_reason "abort"); returns how many."""
        for request_id in list(self._live):
            self._async_engine.abort(request_id)
        return len(self._live)

    def _engine_ids(self, request: Request, response_id: str, count: int) -> list[str]:
        chosen = self._ids_from_client and client_request_id(request) is not None
        base = f"{response_id}-{uuid.uuid4().hex[:8]}" if chosen else uuid.uuid4().hex
        return [f"{base}-{i}" for i in range(count)]

    def _abort_on_disconnect(self, request: Request, request_ids: list[str]) -> asyncio.Task:
        """A task that aborts the engine requests once the client goes away (cancel it when they are done)."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for request_id in request_ids:
                self._async_engine.abort(request_id)
        return asyncio.create_task(watch())
