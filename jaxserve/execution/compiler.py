"""Step programs: one per token bucket, compiled ahead of time, so nothing compiles on a request's path.

1. Every step is padded to a token bucket fixed at start (`layouts`); each bucket has its own program.
   Where the programs verify draft tokens (speculative decoding), a bucket also has a plain program
   (`plain_layouts`) for the steps that verify none: the same step without the draft rows' branch, so an
   engine that does not draft runs what an engine without speculation runs.
2. `warmup` compiles them all (lowered and compiled, never run). With `background=True` it returns once
   the one program that can run any step is ready (the smallest bucket that holds a decode of every slot)
   and compiles the rest on a thread: until a bucket is ready, steps go to the next bigger ready one and
   the scheduler plans no step bigger than the biggest ready one (`step_token_limit`).
3. A program this code compiled before, for the same shapes and devices, is loaded from the program cache
   (`program_cache.py`) without being traced: `program_key` names everything a program is made from.
4. Compilations are counted per engine (`compile_events.py`), warm-up's apart, so tests can assert that
   no step compiles anything.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import jax
from tqdm.auto import tqdm

from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.compile_events import CompileEvents
from jaxserve.execution.host_memory import release_freed_memory
from jaxserve.execution.program_cache import ProgramCache
from jaxserve.execution.programs import abstract

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmupReport:
    programs: int  # step programs compiled
    cache_hits: int  # of those, loaded from a persistent cache (JAX's, or the program cache)
    seconds: float
    program_cache_hits: int = 0  # of the hits, executables loaded without tracing (program_cache.py)


class StepCompiler:
    def __init__(self, step, layouts: dict[int, BatchLayout], program_inputs: Callable[[BatchLayout], tuple],
                 key_parts: tuple, devices, min_bucket: int, events: CompileEvents,
                 plain_layouts: dict[int, BatchLayout] | None = None):
        """`step`: the jitted step; `program_inputs(layout)`: its arguments as shapes and shardings;
        `key_parts`: what else the program is made of (the step's compile options too); `min_bucket`: the
        tokens the first program must hold; `plain_layouts`: per bucket, the layout of steps that verify no
        drafts, where `layouts` verify them (None: `layouts` are plain already)."""
        self.step = step
        self.layouts = layouts
        self.plain_layouts = plain_layouts or {}
        self.program_inputs = program_inputs
        self.key_parts = key_parts
        self.devices = devices
        self.min_bucket = min_bucket
        self.events = events
        self.programs = ProgramCache(None)  # set by warmup(): beside JAX's persistent cache, when it has one
        self._compiled: dict[BatchLayout, jax.stages.Compiled] = {}  # each layout's step, compiled by warmup()
        # Buckets whose program is ready, ascending; replaced whole (never mutated) by the warm-up thread.
        # Before warm-up every bucket counts as ready (its program compiles when first used).
        self.ready_buckets: tuple[int, ...] = tuple(layouts)
        self.warmup_done = threading.Event()
        self.warmup_report: WarmupReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- what a step runs -----------------------------------------------------------------------------

    def layout_for(self, num_tokens: int, verifies: bool = True) -> BatchLayout:
        """The layout of the smallest bucket with a ready program that holds `num_tokens`: its plain one when
        the step verifies no drafts (`verifies` False) and the bucket has one compiled."""
        bucket = next(b for b in self.ready_buckets if b >= num_tokens)
        plain = None if verifies else self.plain_layouts.get(bucket)
        return plain if plain is not None and plain in self._compiled else self.layouts[bucket]

    def bucket_layouts(self, bucket: int) -> list[BatchLayout]:
        """Every program layout of `bucket`: the one that can run any step first, then its plain one."""
        plain = self.plain_layouts.get(bucket)
        return [self.layouts[bucket]] + ([plain] if plain is not None else [])

    @property
    def step_token_limit(self) -> int:
        """The most tokens one step may hold now: the budget, or less while programs are still compiling."""
        return self.ready_buckets[-1]

    def program(self, layout: BatchLayout, with_logits: bool):
        """The callable that runs a step of `layout`: its compiled program, or the jitted step (which
        compiles on first use: steps with every row's logits, and anything before warm-up)."""
        compiled = None if with_logits else self._compiled.get(layout)
        if compiled is not None:
            return compiled
        return lambda *args: self.step(*args, layout, with_logits)

    # ---- warm-up --------------------------------------------------------------------------------------

    def compile_order(self) -> list[int]:
        """The bucket that holds a decode of every slot first (alone it can run any step, if slowly), then
        the rest from the biggest down: a step padded up to the next ready program wastes more the bigger
        the program it lacks."""
        buckets = list(self.layouts)
        first = next(b for b in buckets if b >= self.min_bucket)
        return [first] + sorted((b for b in buckets if b != first), reverse=True)

    def warmup(self, background: bool = False, on_done=None,
               build: Callable[[BatchLayout], None] | None = None) -> WarmupReport | None:
        """Compile the step of every token bucket ahead of time, running none of them: a full-size prefill
        bucket of a big model costs seconds to run and teaches the compiler nothing. `build(layout)` makes a
        bucket's program (default: load or compile it here). With `background`, return once the first
        program is ready and compile the rest on a thread; `warmup_report` is filled, `on_done(report)`
        called and `warmup_done` set when all are."""
        build = build or self.build
        start = time.perf_counter()
        hits, loaded = self.events.cache_hits, self.events.program_cache_hits
        self.programs = ProgramCache.beside_jax_cache()
        order = self.compile_order()
        self.ready_buckets = ()
        bar = tqdm(total=sum(len(self.bucket_layouts(b)) for b in order), desc="Compiling", unit="program")
        self._compile([order[0]] if background else order, bar, build)

        def finish() -> None:
            bar.close()
            executables = self.events.program_cache_hits - loaded
            programs = sum(len(self.bucket_layouts(b)) for b in self.ready_buckets)
            self.warmup_report = WarmupReport(programs, self.events.cache_hits - hits + executables,
                                              time.perf_counter() - start, executables)
            logger.info("compiled %d step programs (token buckets %s) in %.1fs, %d from the persistent "
                        "compilation cache (%d of them as executables, not traced)", self.warmup_report.programs,
                        ",".join(map(str, self.ready_buckets)), self.warmup_report.seconds,
                        self.warmup_report.cache_hits, executables)
            released = release_freed_memory()  # what loading and compiling freed, still held by malloc
            if released:
                logger.info("returned %.0f MB of host memory freed while loading and compiling to the OS",
                            released / 2**20)
            if on_done is not None:
                on_done(self.warmup_report)
            self.warmup_done.set()

        def rest() -> None:
            for bucket in order[1:]:
                if self._stop.is_set():
                    break
                try:
                    self._compile([bucket], bar, build)
                except Exception:  # serving goes on with the programs that are ready
                    logger.exception("compiling the step program for %d tokens failed; steps of that size use "
                                     "the next bigger ready program", bucket)
            finish()

        if background and len(order) > 1:
            logger.info("step program for %d tokens ready after %.1fs; compiling %d more in the background",
                        order[0], time.perf_counter() - start, len(order) - 1)
            # Not a daemon: a process exiting in the middle of an XLA compilation aborts. `stop` makes it
            # stop after the program it is compiling.
            self._thread = threading.Thread(target=rest, name="jaxserve-warmup")
            self._thread.start()
        else:
            finish()
        return self.warmup_report

    def stop(self, timeout: float | None = None) -> None:
        """Compile no more programs in the background; wait (up to `timeout`) for the one in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _compile(self, buckets: list[int], bar, build: Callable[[BatchLayout], None]) -> None:
        for bucket in buckets:
            with self.events.counting(warmup=True):
                for layout in self.bucket_layouts(bucket):
                    build(layout)
                    bar.update()
            self.ready_buckets = tuple(sorted(self.ready_buckets + (bucket,)))

    def build(self, layout: BatchLayout) -> None:
        """The step program of `layout`: from the program cache when this code has compiled it before, else
        lowered and compiled (through JAX's persistent cache) and stored. Called inside `events.counting`."""
        key = self.program_key(layout)
        compiled = self.programs.load(key, self.devices)
        if compiled is not None:
            self.events.loaded_from_program_cache()
            self._compiled[layout] = compiled
            return
        hits = self.events.cache_hits
        compiled = self.lower(layout).compile()
        # An executable JAX itself loaded from its persistent cache does not serialize whole on XLA:CPU: its
        # copy would load, then fail at the first step ("Function ... not found"). Only a program compiled
        # here goes in; one that came from JAX's cache is stored when a run compiles it afresh.
        if self.events.cache_hits == hits:
            self.programs.store(key, compiled)
        self._compiled[layout] = compiled

    def program_key(self, layout: BatchLayout) -> str:
        return ProgramCache.key(abstract(self.program_inputs(layout)), layout, *self.key_parts)

    def lower(self, layout: BatchLayout):
        return self.step.lower(*self.program_inputs(layout), layout, False)

