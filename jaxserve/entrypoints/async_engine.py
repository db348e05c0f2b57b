"""The engine loop: device steps on a dedicated thread, results streamed to asyncio callers.

1. `start()` spawns the engine thread, which loads the model, compiles every program (warm-up) and sets
   `ready`; until then servers answer 503. If that fails, `start_error` holds what to tell the user (the
   error itself when its message names the file or option to change) and `on_failure` fires, as below.
2. `generate()` (asyncio side) queues a request the engine has checked (`Engine.check_request`, which the
   caller runs first, off the event loop, for every prompt before it queues any), then yields each
   `RequestOutput` the thread posts to the request's queue through `call_soon_threadsafe`; `embed()` does
   the same for a checked pooling request (`Engine.pooling.check`) and its one `EmbeddingRequestOutput`.
3. If the caller goes away (client disconnect, cancellation) before the request finishes, the `finally`
   aborts it; the engine frees its slot and pages at its next step.
4. The thread sleeps on an event while there is no work, so an idle server burns no CPU.
   If a step raises, every waiting request gets `EngineDeadError` and `on_failure` tells the server,
   which exits non-zero: state on the device may be inconsistent, so a restart is the safe recovery.
5. Multi-host: this runs on process 0 only; when the loop ends it releases the follower processes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from jaxserve.engine.engine import Engine
from jaxserve.engine.pooling_requests import CheckedPooling
from jaxserve.engine_args import EngineArgs
from jaxserve.engine.startup import reported
from jaxserve.errors import ACTIONABLE_ERRORS
from jaxserve.outputs import RequestOutput
from jaxserve.pooling.params import EmbeddingRequestOutput
from jaxserve.scheduling.validation import CheckedRequest
from sharding import multihost

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread failed; in-flight requests get this and the server reports unhealthy."""


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, engine: Engine | None = None, background_warmup: bool = False):
        self.args = args
        self.engine = engine
        self.background_warmup = background_warmup  # see Engine.warmup
        self.ready = threading.Event()
        self.error: str | None = None
        self._start_failure: Exception | None = None  # what failed before `ready`, if anything did
        self.warmup_seconds: float | None = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        # Called (from the engine thread) once the engine has failed, after every waiter got its error:
        # the server exits non-zero so a supervisor restarts it. It may come before the server runs.
        self.on_failure: Callable[[], None] | None = None

    @property
    def start_error(self) -> Exception | None:
        """Why the engine never became ready (None if it did, or has not failed yet): the error itself when
        its message says what to change, else an `EngineStartError` pointing at the logged traceback."""
        return None if self._start_failure is None else reported(self._start_failure)

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop (which releases multi-host followers) and the background warm-up, then leave the
        distributed runtime together with the other processes, if this process joined one."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.runner.stop_warmup(timeout)
        multihost.shutdown()

    def _run(self) -> None:
        try:
            if self.engine is None:
                self.engine = Engine(self.args)
            self.warmup_seconds = self.engine.warmup(background=self.background_warmup)
            self.ready.set()
            while not self._stop.is_set():
                self._wake.clear()
                if not self.engine.has_unfinished():
                    if self.engine.calibration_due:  # background compilation is done: time its programs
                        self.engine.calibrate_step_cost(max_buckets=1)
                        continue
                    self._wake.wait(0.5)
                    continue
                self._post_all(self.engine.step())
                self.steps += 1
        except Exception as e:  # the loop must not die silently: fail every waiter and report it
            if self.ready.is_set():
                logger.exception("engine thread failed")
            else:
                self._start_failure = e
                # An error that names the file or option is the whole story; a traceback is for the others.
                logger.error("the engine could not start: %s", e, exc_info=not isinstance(e, ACTIONABLE_ERRORS))
            self.error = f"{type(e).__name__}: {e}"
            self.ready.set()
            for request_id in list(self._queues):
                self._post(request_id, EngineDeadError(self.error))
            if self.on_failure is not None:
                self.on_failure()
        finally:
            if self.engine is not None and self.ready.is_set():
                try:
                    self.engine.release()  # multi-host: the other processes return
                except Exception:  # noqa: BLE001 - shutting down anyway
                    logger.exception("could not release follower processes")

    def _post(self, request_id: str, item) -> None:
        target = self._queues.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _post_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops: one wake-up per loop per step, not one per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    # ---- requests (asyncio side) ------------------------------------------------------------------

    async def generate(self, request: CheckedRequest, request_id: str,
                       prompt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a checked request and yield its outputs (every choice's, each with its `index`) until all
        its choices are finished."""
        if self.error:
            raise EngineDeadError(self.error)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), q)
        running = request.params.n
        finished = False
        try:
            self.engine.submit(request, request_id, prompt)
            self._wake.set()
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                running -= item.finished
                finished = running == 0
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.engine is not None:
                self.abort(request_id)

    async def embed(self, request: CheckedPooling, request_id: str,
                    prompt: str | None = None) -> EmbeddingRequestOutput | RequestOutput:
        """Queue a checked pooling request and wait for its embedding (a `RequestOutput` with finish_reason
        "abort" instead when it was aborted meanwhile)."""
        if self.error:
            raise EngineDeadError(self.error)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self.engine.pooling.submit(request, request_id, prompt)
            self._wake.set()
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            finished = True
            return item
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.engine is not None:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, output in items:
        q.put_nowait(output)


class TokenTimer:
    """Per-request latency bookkeeping for metrics: time to first token, gaps between tokens, total."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last: float | None = None
        self.first_token: float | None = None
        self.gaps: list[float] = []

    def on_tokens(self, count: int) -> None:
        now = time.perf_counter()
        if count <= 0:
            return
        if self.last is None:
            self.first_token = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now

    @property
    def total(self) -> float:
        return time.perf_counter() - self.start
