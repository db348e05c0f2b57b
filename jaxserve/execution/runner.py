"""Model runner: one ragged step kind, a pure jitted program per token bucket, dispatched asynchronously.

1. `launch(plan)` packs the scheduler's chunks into the step buffers of the smallest token bucket that
   holds them (`batch.py`) and dispatches the jitted step without waiting for it. In a multi-host run the
   leader broadcasts the buffers first and the other processes (`follow`) run the same step on them.
2. The step `(params, kv_cache, prev_samples, buffers) -> (kv_cache, samples, logits)` is one `shard_map`
   over the mesh (even a one-device mesh: one code path). It takes the tokens that are still on the
   device from the previous step's samples, runs every layer over the flat tokens (pipeline stages pass
   microbatches of them along, `sharding/pipeline.py`), writes K/V at their slots and attends through the
   backend's ragged paged attention, then samples each sequence's last row. The cache is donated, so XLA
   updates it in place; explicit in/out shardings mean nothing recompiles for a sharding it had not seen.
3. The samples stay on the device and feed the next step; `StepOutput.tokens()` copies them to the host
   (one small array) when the engine gets round to it, a step later.
4. `warmup` compiles the program of every bucket ahead of time (lowered and compiled, never run); the
   compile counter lets tests assert that none follow. With `background=True` it returns once the one
   program that can run any step is ready (the smallest bucket that holds every decode slot) and compiles
   the rest on a thread: until a bucket is ready, steps go to the next bigger ready one and the scheduler
   plans no step bigger than the biggest ready one, so nothing ever compiles on the step path. A program
   this code compiled before, for the same shapes and devices, is loaded from the program cache
   (`program_cache.py`) without being traced.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.execution.batch import BatchBuilder, BatchLayout, StepBatch
from jaxserve.config import CacheConfig, ModelConfig, SamplerConfig, SchedulerConfig
from jaxserve.model.kv_cache import KVCache
from jaxserve.scheduling.pages import NULL_PAGE, pages_needed
from jaxserve.sampling.logits import apply_token_masks, process, record_tokens, SamplerState, token_logprobs
from jaxserve.execution.program_cache import ProgramCache
from jaxserve.sampling.sampler import sample
from jaxserve.scheduling.scheduler import ScheduledChunk, StepPlan
from jaxserve.loader.placement import ShardedModel
from pallas_kernels.dispatch import AttentionBackend
from sharding import TP_AXES, MeshPlan
from sharding.loading import zeros
from sharding.multihost import END, STEP, StepChannel
from sharding.pipeline import num_microbatches, run_pipeline
from sharding.rules import kv_cache_spec

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResults:
    """What one step returns besides the cache (R = max_num_seqs sample rows, T = the token bucket)."""
    samples: jax.Array  # [R] int32: row i is the token sampled for chunk i of the plan
    sample_logprob: jax.Array  # [R] float32 raw logprob of that token (rows that asked for logprobs)
    sample_rank: jax.Array  # [R] int32 its rank, 1 = the most likely
    top_ids: jax.Array  # [R, K] int32 the K most likely tokens
    top_logprobs: jax.Array  # [R, K] float32 their logprobs
    prompt_logprob: jax.Array  # [T] float32 logprob of each row's `prompt_target` (prompt logprobs)
    prompt_rank: jax.Array  # [T] int32
    prompt_top_ids: jax.Array  # [T, K] int32
    prompt_top_logprobs: jax.Array  # [T, K] float32


@dataclasses.dataclass
class ManualStep:
    """`ModelRunner.run`'s answer, on the host."""
    samples: np.ndarray  # [chunks] the token sampled after each chunk
    logits: np.ndarray  # [tokens, vocab] float32, every row's
    rows: list[slice]  # each chunk's rows of `logits`
    results: StepResults  # everything else the step returned (logprobs), as numpy


@dataclasses.dataclass
class StepOutput:
    """A dispatched step's results, still on the device."""
    plan: StepPlan | None
    results: StepResults
    logits: jax.Array | None  # [tokens, vocab] float32, when asked for

    def tokens(self) -> np.ndarray:
        """Block until the step is done and return its samples on the host."""
        return _host(self.results.samples)

    def logprobs(self) -> StepResults:
        """Every result on the host (numpy); only fetched when some chunk asked for logprobs."""
        return jax.tree.map(_host, self.results)

    def all_logits(self) -> np.ndarray:
        return _host(self.logits)


class ModelRunner:
    def __init__(self, model: ShardedModel, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype,
                 sampler_config: SamplerConfig = SamplerConfig()):
        self.model_config = model_config
        self.sampler_config = sampler_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.attention = attention
        self.dtype = dtype
        self.plan: MeshPlan = model.plan
        self.graphdef, self.params = model.graphdef, model.params
        # The step takes the parameters as a flat tuple: flattening an nnx.State runs Python code for
        # every leaf, on every call, on the critical path of each step.
        self._param_leaves, param_tree = jax.tree.flatten(self.params)
        self._param_leaves = tuple(self._param_leaves)
        self.max_pages_per_seq = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        self.layouts = {b: BatchLayout(b, scheduler_config.seqs_for(b), self.max_pages_per_seq,
                                       sampler_config.max_logit_bias) for b in scheduler_config.token_buckets}
        self.builder = BatchBuilder(scheduler_config.max_num_seqs, self.max_pages_per_seq, cache_config.page_size)
        self.channel = StepChannel()
        # The cache's pages are filled with zeros on a thread: on CPU that is a pass over fresh memory
        # (1 GB for a 1B model: ~1 s), which then overlaps warm-up's first compilation. Compiling needs only
        # the abstract cache; the first access to `kv_cache` waits for the arrays.
        self.kv_abstract = self._abstract_kv_cache()
        self._kv_cache: KVCache | None = None
        filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-cache")
        self._kv_filling = filler.submit(self._new_kv_cache)
        filler.shutdown(wait=False)
        plan = self.plan
        rep = plan.replicated
        self._no_samples = jax.device_put(np.zeros(scheduler_config.max_num_seqs, np.int32), rep)
        self._prev_samples = self._no_samples
        # The allowed-token bitmask of each bucket's sequence rows when no row is constrained: all ones, kept
        # on the device, so unconstrained steps transfer nothing for it.
        self.mask_words = (model_config.vocab_size + 31) // 32
        self._open_masks = {b: jax.device_put(self.open_masks(layout), rep) for b, layout in self.layouts.items()}
        self._compiled: dict[int, jax.stages.Compiled] = {}  # token bucket -> its step, compiled by warmup()
        self.programs = ProgramCache(None)  # set by warmup(): beside JAX's persistent cache, when it has one
        # Buckets whose program is ready, ascending; replaced whole (never mutated) by the warm-up thread.
        self.ready_buckets: tuple[int, ...] = tuple(self.layouts)
        self.warmup_done = threading.Event()
        self.warmup_report: WarmupReport | None = None
        self._warmup_stop = threading.Event()
        self._warmup_thread: threading.Thread | None = None
        # Per slot (and one scratch row for padding): see jaxserve/logits.py.
        state_shape = (scheduler_config.max_num_seqs + 1, model_config.vocab_size)
        self.sampler_state = SamplerState(zeros(state_shape, jnp.int32, rep), zeros(state_shape, jnp.bool_, rep))
        state_sharding = jax.tree.map(lambda a: a.sharding, self.sampler_state)

        kv_sharding = jax.tree.map(lambda a: a.sharding, self.kv_abstract)
        kv_specs = jax.tree.map(lambda a: a.sharding.spec, self.kv_abstract)
        step_kwargs = dict(graphdef=self.graphdef, attention=attention, config=model_config, pp=plan.pp,
                           num_samples=scheduler_config.max_num_seqs, top=sampler_config.max_logprobs)

        def step(param_leaves, kv_cache, sampler_state, prev_samples, ints, floats, masks, layout, with_logits):
            # check_vma=False: the outputs are replicated by construction (all-reduced or all-gathered,
            # then computed identically on every device); we do not ask JAX to prove it per value.
            local = functools.partial(_step_local, **step_kwargs, layout=layout, with_logits=with_logits)
            params = jax.tree.unflatten(param_tree, param_leaves)
            return jax.shard_map(local, mesh=plan.mesh, in_specs=(model.specs, kv_specs, P(), P(), P(), P(), P()),
                                 out_specs=(kv_specs, P(), P(), P()), check_vma=False)(
                params, kv_cache, sampler_state, prev_samples, ints, floats, masks)

        # Layout and the logits flag are static (one program each) and positional: jit takes no kwargs
        # with in_shardings. The cache and the sampler state are donated: updated in place.
        self._step = jax.jit(step, static_argnums=(7, 8), donate_argnums=(1, 2),
                             in_shardings=(tuple(a.sharding for a in self._param_leaves), kv_sharding,
                                           state_sharding, rep, rep, rep, rep),
                             out_shardings=(kv_sharding, state_sharding, rep, rep))

    def _abstract_kv_cache(self) -> KVCache:
        """Per layer slot: pages [pp * num_kv_heads, num_pages, page_size, head_dim], as shapes and shardings."""
        c, plan = self.model_config, self.plan
        shape = (plan.pp * c.num_kv_heads, self.cache_config.num_pages, self.cache_config.page_size, c.head_dim)
        pages = jax.ShapeDtypeStruct(shape, self.dtype, sharding=plan.sharding(kv_cache_spec()))
        return KVCache(k=[pages] * plan.layers_per_stage, v=[pages] * plan.layers_per_stage)

    def _new_kv_cache(self) -> KVCache:
        """The cache's arrays, created in place on their devices."""
        return jax.tree.map(lambda a: zeros(a.shape, a.dtype, a.sharding), self.kv_abstract)

    @property
    def kv_cache(self) -> KVCache:
        if self._kv_cache is None:
            self._kv_cache = self._kv_filling.result()
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, value: KVCache) -> None:
        self._kv_cache = value

    # ---- host side -------------------------------------------------------------------------------------

    def layout_for(self, num_tokens: int) -> BatchLayout:
        """The smallest bucket with a ready program that holds `num_tokens`."""
        return self.layouts[next(b for b in self.ready_buckets if b >= num_tokens)]

    @property
    def step_token_limit(self) -> int:
        """The most tokens one step may hold now: the budget, or less while programs are still compiling."""
        return self.ready_buckets[-1]

    def open_masks(self, layout: BatchLayout) -> np.ndarray:
        """A step's allowed-token bitmask with every token allowed: [sequence rows, ceil(vocab / 32)] int32.
        Fill a constrained row (bit t % 32 of word t // 32 for token t) and pass it to `launch`."""
        return np.full((layout.seqs, self.mask_words), -1, np.int32)

    def launch(self, plan: StepPlan, with_logits: bool = False, masks: np.ndarray | None = None) -> StepOutput:
        """Dispatch one step of the plan; returns without waiting for the device. `masks`: the allowed-token
        bitmask of the plan's rows (`open_masks` filled in), when some row is constrained."""
        layout = self.layout_for(plan.num_tokens)
        ints, floats = self.builder.build(plan.chunks, layout, constrained=masks is not None)
        return self._lead(plan, layout, ints, floats, masks, with_logits)

    def _lead(self, plan, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray, masks: np.ndarray | None,
              with_logits: bool) -> StepOutput:
        """Hand the step to the follower processes (multi-host), then dispatch it here."""
        flags = int(with_logits) | (_HAS_MASKS if masks is not None else 0)
        self.channel.send(STEP, layout.tokens, flags, (ints, floats) if masks is None else (ints, floats, masks))
        return self._dispatch(plan, layout, ints, floats, masks, with_logits)

    def _dispatch(self, plan, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray, masks: np.ndarray | None,
                  with_logits: bool) -> StepOutput:
        # Masks go in as committed device arrays either way: a host array would be another program to compile.
        masks = self._open_masks[layout.tokens] if masks is None else jax.device_put(masks, self.plan.replicated)
        args = (self._param_leaves, self.kv_cache, self.sampler_state, self._prev_samples, ints, floats, masks)
        compiled = None if with_logits else self._compiled.get(layout.tokens)
        step = compiled(*args) if compiled is not None else self._step(*args, layout, with_logits)
        self.kv_cache, self.sampler_state, results, logits = step
        self._prev_samples = results.samples
        results.samples.copy_to_host_async()  # the engine reads them next iteration; start the copy now
        return StepOutput(plan, results, logits)

    def run(self, chunks: list[ScheduledChunk], masks: np.ndarray | None = None) -> ManualStep:
        """One step with every row's logits, waited for (research, tests). Not while the engine has
        requests running: their next step would read this step's samples as their pending tokens.
        `masks`: allowed-token bitmasks of the chunks' draws (see `open_masks`); the logits stay unmasked."""
        out = self.launch(StepPlan(chunks, sum(c.num_tokens for c in chunks)), with_logits=True, masks=masks)
        bounds = np.cumsum([0] + [c.num_tokens for c in chunks])
        results = out.logprobs()
        return ManualStep(results.samples[:len(chunks)], out.all_logits(),
                          [slice(a, b) for a, b in zip(bounds, bounds[1:])], results)

    # ---- multi-host ---------------------------------------------------------------------------------

    def end_call(self) -> None:
        """Leader: tell the followers that this burst of steps is over (they return from `follow`)."""
        self.channel.send(END)

    def follow(self) -> int:
        """Follower: run the leader's steps, in order, until it ends the burst. Returns steps run."""
        steps = 0
        while True:
            kind, tokens, flag = self.channel.receive_header()
            if kind == END:
                return steps
            if kind != STEP:
                raise RuntimeError(f"unknown step kind {kind} from the leader")
            layout = self.layouts[tokens]
            template = layout.empty(self.builder.scratch_slot)
            if flag & _HAS_MASKS:
                ints, floats, masks = self.channel.receive_batch((*template, self.open_masks(layout)))
                masks = np.asarray(masks)
            else:
                (ints, floats), masks = self.channel.receive_batch(template), None
            self._dispatch(None, layout, np.asarray(ints), np.asarray(floats), masks, bool(flag & _WITH_LOGITS))
            steps += 1

    def warmup(self, background: bool = False, on_done=None) -> WarmupReport | None:
        """Compile the step of every token bucket ahead of time, running none of them: a full-size prefill
        bucket of a big model costs seconds to run and teaches the compiler nothing. With `background`,
        return once the first program (see `compile_order`) is ready and compile the rest on a thread;
        `warmup_report` is filled, `on_done(report)` called and `warmup_done` set when all are."""
        start = time.perf_counter()
        hits, loaded = CompilationEvents.cache_hits, CompilationEvents.program_cache_hits
        self.programs = ProgramCache.beside_jax_cache()
        order = self.compile_order()
        if background and self.plan.process_count > 1:
            background = False  # followers compile as the leader's steps reach them: one program at a time
        self.ready_buckets = ()
        bar = tqdm(total=len(order), desc="Compiling", unit="program")
        first = order[:1] if background else order
        self._compile_all(first, bar)
        self._prev_samples = self._no_samples  # the followers' warm-up ran steps (on the null page)
        self.kv_cache  # noqa: B018 - ready means the cache is filled too (it was, meanwhile, on its thread)

        def finish() -> None:
            bar.close()
            executables = CompilationEvents.program_cache_hits - loaded
            self.warmup_report = WarmupReport(len(self.ready_buckets),
                                              CompilationEvents.cache_hits - hits + executables,
                                              time.perf_counter() - start, executables)
            logger.info("compiled %d step programs (token buckets %s) in %.1fs, %d from the persistent "
                        "compilation cache (%d of them as executables, not traced)", self.warmup_report.programs,
                        ",".join(map(str, self.ready_buckets)), self.warmup_report.seconds,
                        self.warmup_report.cache_hits, executables)
            if on_done is not None:
                on_done(self.warmup_report)
            self.warmup_done.set()

        def rest() -> None:
            for bucket in order[1:]:
                if self._warmup_stop.is_set():
                    break
                try:
                    self._compile_all([bucket], bar)
                except Exception:  # serving goes on with the programs that are ready
                    logger.exception("compiling the step program for %d tokens failed; steps of that size use "
                                     "the next bigger ready program", bucket)
            finish()

        if background and len(order) > 1:
            logger.info("step program for %d tokens ready after %.1fs; compiling %d more in the background",
                        order[0], time.perf_counter() - start, len(order) - 1)
            # Not a daemon: a process exiting in the middle of an XLA compilation aborts. `stop_warmup` makes
            # it stop after the program it is compiling.
            self._warmup_thread = threading.Thread(target=rest, name="jaxserve-warmup")
            self._warmup_thread.start()
        else:
            finish()
        return self.warmup_report

    def stop_warmup(self, timeout: float | None = None) -> None:
        """Compile no more programs in the background; wait (up to `timeout`) for the one in progress."""
        self._warmup_stop.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join(timeout)

    def compile_order(self) -> list[int]:
        """The bucket that holds a decode of every slot first (alone it can run any step, if slowly), then
        the rest from the biggest down: a step padded up to the next ready program wastes more the bigger
        the program it lacks."""
        buckets = list(self.layouts)
        first = next(b for b in buckets if b >= self.scheduler_config.max_num_seqs)
        return [first] + sorted((b for b in buckets if b != first), reverse=True)

    def _compile_all(self, buckets: list[int], bar) -> None:
        for bucket in buckets:
            layout = self.layouts[bucket]
            with CompilationEvents.warming_up():
                if self.plan.process_count > 1:
                    # Every process must compile the program its collectives run: the followers compile when
                    # the leader's step reaches them. No sequences: every token writes to the null page.
                    self._lead(None, layout, *layout.empty(self.builder.scratch_slot), None, with_logits=False).tokens()
                else:
                    self._compiled[bucket] = self._load_or_compile(layout)
            self.ready_buckets = tuple(sorted(self.ready_buckets + (bucket,)))
            bar.update()

    def _load_or_compile(self, layout: BatchLayout) -> jax.stages.Compiled:
        """The step program of `layout`: from the program cache when this code has compiled it before,
        else lowered and compiled (through JAX's persistent cache) and stored."""
        key = ProgramCache.key(_abstract(self._program_inputs(layout)), layout, self.graphdef, self.attention,
                               self.model_config, self.plan.pp, self.plan.mesh.device_ids,
                               self.scheduler_config.max_num_seqs, self.sampler_config.max_logprobs)
        compiled = self.programs.load(key, self.plan.mesh.devices.flat)
        if compiled is not None:
            CompilationEvents.loaded_from_program_cache()
            return compiled
        compiled = self._lower(layout).compile()
        self.programs.store(key, compiled)
        return compiled

    def _program_inputs(self, layout: BatchLayout) -> tuple:
        # Abstract arguments: the engine thread may be running (and donating) the cache and sampler state
        # meanwhile; only their shapes and shardings matter here.
        ints, floats = layout.empty(self.builder.scratch_slot)
        return (_abstract(self._param_leaves), self.kv_abstract, _abstract(self.sampler_state),
                _abstract(self._no_samples), ints, floats, self._open_masks[layout.tokens])

    def _lower(self, layout: BatchLayout):
        return self._step.lower(*self._program_inputs(layout), layout, False)


_WITH_LOGITS, _HAS_MASKS = 1, 2  # bits of the step header's flag (multi-host)


@dataclasses.dataclass
class WarmupReport:
    programs: int  # step programs compiled
    cache_hits: int  # of those, loaded from a persistent cache (JAX's, or the program cache)
    seconds: float
    program_cache_hits: int = 0  # of the hits, executables loaded without tracing (jaxserve/program_cache.py)


class CompilationEvents:
    """What JAX compiles in this process, from its monitoring events: programs lowered (each new jitted
    shape is one) and persistent-cache hits."""

    _LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
    _CACHE_HIT = "/jax/compilation_cache/cache_hits"
    _lock = threading.Lock()
    _thread = threading.local()
    lowered = 0  # outside warm-up: what a step had to compile
    lowered_in_warmup = 0
    cache_hits = 0
    program_cache_hits = 0  # counted by the runner: these never reach JAX's compile path
    _installed = False

    @classmethod
    @contextlib.contextmanager
    def warming_up(cls):
        """Count this thread's lowerings as warm-up's (which may go on in the background while serving)."""
        cls._thread.warmup = True
        try:
            yield
        finally:
            cls._thread.warmup = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._installed:
                jax.monitoring.register_event_duration_secs_listener(cls._on_duration)
                jax.monitoring.register_event_listener(cls._on_event)
                cls._installed = True

    @classmethod
    def _on_duration(cls, event: str, duration: float, **_) -> None:
        if event == cls._LOWERED:
            if getattr(cls._thread, "warmup", False):
                cls.lowered_in_warmup += 1
            else:
                cls.lowered += 1

    @classmethod
    def loaded_from_program_cache(cls) -> None:
        with cls._lock:  # engines in one process may warm up at once
            cls.program_cache_hits += 1

    @classmethod
    def _on_event(cls, event: str, **_) -> None:
        if event == cls._CACHE_HIT:
            cls.cache_hits += 1


def _abstract(tree):
    """The arrays of `tree` (device or host) as shapes, dtypes and shardings: what lowering a program needs
    of them, and what the program cache keys it by."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)


def _host(x: jax.Array) -> np.ndarray:
    """A replicated output to numpy; in a multi-host run only this process's copy is addressable."""
    return np.asarray(x.addressable_data(0))


# ---- the pure jitted step (body of the shard_map: every array here is this device's shard) -------------

def _microbatch_view(cu_q_lens: jax.Array, kv_lens: jax.Array, lo: jax.Array, size: int):
    """The ragged layout as tokens lo .. lo + size - 1 see it: rows outside belong to no sequence, and a
    sequence's tokens after the microbatch are not in the cache yet (later microbatches write them)."""
    cu = jnp.clip(cu_q_lens, lo, lo + size) - lo
    later = jnp.maximum(cu_q_lens[1:] - jnp.maximum(cu_q_lens[:-1], lo + size), 0)
    return cu, kv_lens - later


def _null_writes(write_index: jax.Array, valid: jax.Array) -> jax.Array:
    # A pipeline bubble step computes on filler data: send its K/V to the null page.
    return jnp.where(valid, write_index, NULL_PAGE)


def _step_local(params, kv_cache: KVCache, sampler_state: SamplerState, prev_samples, ints, floats, masks, *, graphdef,
                attention, config, pp, num_samples: int, top: int, layout: BatchLayout, with_logits: bool):
    model = nnx.merge(graphdef, params)
    batch: StepBatch = layout.unpack(ints, floats)
    # Tokens sampled by the previous step that the host has not seen yet come straight from the device.
    tokens = jnp.where(batch.from_prev >= 0, prev_samples[jnp.maximum(batch.from_prev, 0)], batch.tokens)
    num_tokens = layout.tokens
    seq_of_token = jnp.clip(jnp.searchsorted(batch.cu_q_lens, jnp.arange(num_tokens), side="right") - 1, 0,
                            layout.seqs - 1)
    p = batch.processing
    sampler_state = record_tokens(sampler_state, p.slots, p.fresh, p.slots[seq_of_token], tokens,
                                  batch.token_kind)
    m = num_microbatches(num_tokens, pp)
    size = num_tokens // m
    split = lambda a: a.reshape(m, size)
    micro_tokens, positions, write_index = split(tokens), split(batch.positions), split(batch.write_index)

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])
        cu_q_lens, kv_lens = _microbatch_view(batch.cu_q_lens, batch.kv_lens, micro * size, size)

        def attend(q, k_pages, v_pages):
            return attention.ragged(q, k_pages, v_pages, kv_lens, batch.page_tables, cu_q_lens,
                                    sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window)

        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES)

    hidden, kv_cache = run_pipeline(stage, lambda i: model.embed(micro_tokens[i], TP_AXES), m, kv_cache, pp)
    hidden = model.norm(hidden.reshape(num_tokens, -1))
    # The grammar mask comes first: a token it forbids has no probability at all, logprobs included.
    raw = apply_token_masks(model.logits(hidden[batch.sample_index], TP_AXES), masks, batch.constrained)
    samples = sample(process(raw, sampler_state, p), batch.sampling)
    sample_lp = _maybe_logprobs(jnp.any(batch.logprobs >= 0), lambda: raw, samples, top)
    targets = batch.prompt_target
    prompt_lp = _maybe_logprobs(jnp.any(targets >= 0), lambda: model.logits(hidden, TP_AXES),
                                jnp.maximum(targets, 0), top)
    pad = lambda a: jnp.zeros((num_samples,) + a.shape[1:], a.dtype).at[:layout.seqs].set(a)
    results = StepResults(pad(samples), *map(pad, sample_lp), *prompt_lp)
    logits = model.logits(hidden, TP_AXES) if with_logits else None
    return kv_cache, sampler_state, results, logits


def _maybe_logprobs(wanted, logits_fn, chosen, top: int):
    """`token_logprobs` of the logits `logits_fn` gives, computed only when some row wants them (zeros else)."""
    rows = chosen.shape[0]
    skipped = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
               jnp.zeros((rows, top), jnp.float32))
    return jax.lax.cond(wanted, lambda: token_logprobs(logits_fn(), chosen, top), lambda: skipped)
