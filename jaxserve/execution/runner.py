"""Model runner: the device state of one model, and the step launched on it asynchronously.

1. The runner holds what the step program runs on: the parameters (as a flat tuple of leaves), the paged
   KV cache (zero-filled on a thread while warm-up compiles), the sampler state and the previous step's
   samples, all on the mesh.
2. `launch(step, masks)` packs the plan into the device batch of the smallest token bucket with a ready
   program (`batch.py`, `compiler.py`) and dispatches the step without waiting for it. The grammar masks
   of the plan's rows (when some draw is constrained) go in as one more input of the same program.
3. The samples stay on the device and feed the next step; `LaunchedStep.sampled()` copies them to the
   host (one small array, its copy started at launch) when the engine gets round to it, a step later.
   It notes when they arrived and whether the host had to wait for them: the engine's step-time
   measurements (`jaxserve/scheduling/step_cost.py`). `time_idle_step` times a bucket's program at warm-up,
   and `run_warmup_batches` runs it once through its loops and branches.
4. `run(step)` is one step with every row's logits, waited for (research, parity tests).
5. With LoRA, the adapters' slot stacks (`jaxserve/lora/slots.py`) are one more input of every step;
   `write_lora(slot, adapter)` fills a slot between steps, and no step program changes.
The multi-host leader (`relay.py`) is this runner with its dispatch and warm-up wrapped; nothing here
knows about other processes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from jaxserve.config import CacheConfig, ModelConfig, SamplerConfig, SchedulerConfig
from jaxserve.execution.batch import BatchBuilder, BatchLayout
from jaxserve.execution.compile_events import CompileEvents
from jaxserve.execution.compiler import StepCompiler, WarmupReport
from jaxserve.execution.programs import StepPrograms
from jaxserve.execution.step_program import StepResults
from jaxserve.loader.placement import ShardedModel
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.slots import LoRASlots
from jaxserve.model.kv_cache import KVCache
from jaxserve.scheduling.pages import pages_needed
from jaxserve.scheduling.step import SampledTokens, SampleLogprobs, StepPlan
from pallas_kernels.dispatch import AttentionBackend
from sharding import MeshPlan
from sharding.loading import zeros


@dataclasses.dataclass
class ManualStep:
    """`ModelRunner.run`'s answer, on the host."""
    samples: np.ndarray  # [seqs] the token drawn after each sequence's span (its first draw)
    logits: np.ndarray  # [tokens, vocab] float32, every row's
    rows: list[slice]  # each sequence's rows of `logits`
    results: StepResults  # everything else the step returned (logprobs), as numpy


@dataclasses.dataclass
class LaunchedStep:
    """A dispatched step, its results still on the device."""
    step: StepPlan | None
    results: StepResults
    logits: jax.Array | None  # [tokens, vocab] float32, when asked for
    bucket: int = 0  # the token bucket whose program runs it
    launched_at: float = 0.0  # time.perf_counter() at dispatch
    done_at: float | None = None  # when the host had its samples (set by `sampled`)
    waited: bool = False  # the host blocked for them: `done_at` is when the device finished
    # What the step ran on, for a draft model that follows the target's tokens (`jaxserve/speculative/`).
    layout: BatchLayout | None = None
    ints: np.ndarray | None = None
    floats: np.ndarray | None = None
    prev_samples: jax.Array | None = None  # [max_num_seqs] the previous step's last standing tokens

    def sampled(self) -> SampledTokens:
        """Block until the step is done; its draws on the host (logprobs fetched only when asked for)."""
        rows = len(self.step.seqs)
        draws = self.results.draws
        self.waited = not draws.accepted.is_ready()
        accepted = to_host(draws.accepted)[:rows]
        tokens = to_host(draws.tokens)[:rows]
        self.done_at = time.perf_counter()
        drew = np.fromiter((seq.samples for seq in self.step.seqs), np.bool_, rows)
        pooled = None if self.results.pooled is None else to_host(self.results.pooled)[:rows]
        return SampledTokens(tokens, np.where(drew, accepted, 0).astype(np.int32), self.logprobs, pooled)

    def logprobs(self) -> SampleLogprobs:
        r = jax.tree.map(to_host, self.results)
        d = r.draws
        return SampleLogprobs(d.sample_logprob, d.sample_rank, d.top_ids, d.top_logprobs, r.prompt_logprob,
                              r.prompt_rank, r.prompt_top_ids, r.prompt_top_logprobs)


class ModelRunner:
    def __init__(self, model: ShardedModel, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype,
                 sampler_config: SamplerConfig = SamplerConfig(), events: CompileEvents | None = None,
                 pooling: bool = False, lora: LoRASlots | None = None, max_drafts: int = 0,
                 compiler_options: dict | None = None):
        """`pooling`: the pooling runner's step program (pooled rows, no sampling; `--runner pooling`);
        `lora`: the LoRA adapters' device slots (`enable_lora`); `max_drafts`: draft tokens a sequence may
        verify per step (speculative decoding; 0: off); `compiler_options`: XLA options of the step programs
        (`cpu_matmuls.py`)."""
        self.model_config = model_config
        self.sampler_config = sampler_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.attention = attention
        self.dtype = dtype
        self.events = events or CompileEvents()
        self.lora = lora
        self.plan: MeshPlan = model.plan
        self.graphdef, self.params = model.graphdef, model.params
        self.layer_repeats = model.layer_repeats  # > 1: layers under lax.scan (jaxserve/model/layer_loop.py)
        self._param_leaves = tuple(jax.tree.leaves(self.params))
        max_seqs = scheduler_config.max_num_seqs
        self.programs = StepPrograms.build(model, model_config, cache_config, scheduler_config, attention, dtype,
                                           sampler_config, pooling, None if lora is None else lora.stack,
                                           max_drafts, compiler_options)
        self.max_pages_per_seq = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        self.builder = BatchBuilder(max_seqs, self.max_pages_per_seq, cache_config.page_size)
        # The cache's pages are filled with zeros on a thread: on CPU that is a pass over fresh memory
        # (1 GB for a 1B model: ~1 s), which then overlaps warm-up's first compilation. Compiling needs only
        # the abstract cache; the first access to `kv_cache` waits for the arrays.
        self.kv_abstract = self.programs.kv_cache
        self._kv_cache: KVCache | None = None
        filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-cache")
        self._kv_filling = filler.submit(self._new_kv_cache)
        filler.shutdown(wait=False)
        rep = self.plan.replicated
        self._no_samples = jax.device_put(np.zeros(max_seqs, np.int32), rep)
        self._prev_samples = self._no_samples
        # The allowed-token bitmask of each bucket's sequence rows when no row is constrained: all ones, kept
        # on the device, so unconstrained steps transfer nothing for it.
        self.mask_words = self.programs.mask_words
        self._open_masks = {b: jax.device_put(self._all_allowed(layout.seqs), rep)
                            for b, layout in self.programs.layouts.items()}
        # Per slot, and one scratch row for padding (see jaxserve/sampling/logits.py).
        self.sampler_state = jax.tree.map(lambda a: zeros(a.shape, a.dtype, a.sharding), self.programs.sampler_state)
        self.compiler = StepCompiler(self.programs.step, self.programs.layouts, self.programs.inputs,
                                     (self.graphdef, attention, model_config, self.plan.pp, self.plan.mesh.device_ids,
                                      max_seqs, sampler_config.max_logprobs, pooling,
                                      sorted((compiler_options or {}).items())),
                                     list(self.plan.mesh.devices.flat), max_seqs, self.events)

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

    def _all_allowed(self, rows: int) -> np.ndarray:
        return np.full((rows, self.mask_words), -1, np.int32)

    # ---- compiling --------------------------------------------------------------------------------------

    @property
    def layouts(self) -> dict[int, BatchLayout]:
        return self.compiler.layouts

    @property
    def ready_buckets(self) -> tuple[int, ...]:
        """Token buckets whose program is ready (all of them once warm-up is done)."""
        return self.compiler.ready_buckets

    @property
    def step_token_limit(self) -> int:
        return self.compiler.step_token_limit

    @property
    def warmup_report(self) -> WarmupReport | None:
        return self.compiler.warmup_report

    def warmup(self, background: bool = False, on_done=None) -> WarmupReport | None:
        """Compile every bucket's step program (see `StepCompiler.warmup`); ready means the KV cache is filled."""
        if self.lora is not None:
            with self.events.counting(warmup=True):
                self.lora.warm_up()
        report = self.compiler.warmup(background, on_done, self._build_program)
        self.kv_cache  # noqa: B018 - it was being filled, meanwhile, on its thread
        return report

    def _build_program(self, layout: BatchLayout) -> None:
        self.compiler.build(layout)

    def stop_warmup(self, timeout: float | None = None) -> None:
        self.compiler.stop(timeout)

    # ---- a caller's call (multi-host: relay.py wraps these) ----------------------------------------------

    def call(self, work, on_follower=None):
        """Run one call of the engine's caller (an `LLM.generate`, a server's lifetime): here, just `work()`."""
        return work()

    def release(self) -> None:
        """The caller is done with the engine (nothing to do in a single process)."""

    # ---- LoRA slots -------------------------------------------------------------------------------------

    def write_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Load `adapter` into LoRA slot `slot` (None: clear it), between steps, on the engine thread."""
        with self.events.counting():
            self.lora.write(slot, adapter)

    # ---- running ----------------------------------------------------------------------------------------

    def launch(self, step: StepPlan, masks: np.ndarray | None = None, with_logits: bool = False) -> LaunchedStep:
        """Dispatch one step of the plan; returns without waiting for the device. `masks`: the allowed-token
        bitmask of the plan's rows ([rows, ceil(vocab / 32)] int32), when some draw is constrained."""
        layout = self.compiler.layout_for(step.num_tokens)
        ints, floats = self.builder.build(step, layout, constrained=masks is not None)
        if masks is not None:  # the plan's rows, then all-allowed padding rows up to the layout's
            masks = np.concatenate([masks, self._all_allowed(layout.seqs - len(masks))])
        return self.dispatch(step, layout, ints, floats, masks, with_logits)

    def dispatch(self, step: StepPlan | None, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray,
                  masks: np.ndarray | None, with_logits: bool) -> LaunchedStep:
        # Masks go in as committed device arrays either way: a host array would be another program to compile.
        masks = self._open_masks[layout.tokens] if masks is None else jax.device_put(masks, self.plan.replicated)
        prev_samples = self._prev_samples
        args = (self._param_leaves, self.kv_cache, self.sampler_state, prev_samples, ints, floats, masks,
                None if self.lora is None else self.lora.stack)
        launched_at = time.perf_counter()
        with self.events.counting():
            self.kv_cache, self.sampler_state, results, logits = self.compiler.program(layout, with_logits)(*args)
        self._prev_samples = results.draws.last
        for out in (results.draws.tokens, results.draws.accepted):
            out.copy_to_host_async()  # the engine reads them next iteration; start the copy now
        if results.pooled is not None:
            results.pooled.copy_to_host_async()
        return LaunchedStep(step, results, logits, bucket=layout.tokens, launched_at=launched_at, layout=layout,
                            ints=ints, floats=floats, prev_samples=prev_samples)

    def time_idle_step(self, bucket: int) -> float:
        """Seconds one step of `bucket`'s ready program takes, dispatch to samples on the host, with no
        sequence in it (every token writes to the null page). Only while no request runs."""
        layout = self.layouts[bucket]
        start = time.perf_counter()
        to_host(self.dispatch(None, layout, *layout.empty(), None, with_logits=False).results.draws.last)
        seconds = time.perf_counter() - start
        self._prev_samples = self._no_samples
        return seconds

    def run_warmup_batches(self, bucket: int) -> None:
        """Run `bucket`'s program on the builder's warm-up batches (greedy, then every option) and wait: the
        first runs of its loops and branches are paid here rather than by the first requests. Only while
        no request runs."""
        layout = self.layouts[bucket]
        for every_option in (False, True):
            ints, floats = self.builder.warmup(layout, every_option)
            masks = self._all_allowed(layout.seqs) if every_option else None
            to_host(self.dispatch(None, layout, ints, floats, masks, with_logits=False).results.draws.last)
        self._prev_samples = self._no_samples

    def run(self, step: StepPlan, masks: np.ndarray | None = None) -> ManualStep:
        """One step with every row's logits, waited for (research, tests). Not while the engine has
        requests running: their next step would read this step's samples as their pending tokens.
        `masks`: allowed-token bitmasks of the plan's draws; the logits stay unmasked."""
        out = self.launch(step, masks=masks, with_logits=True)
        bounds = np.cumsum([0] + [seq.num_tokens for seq in step.seqs])
        results = jax.tree.map(to_host, out.results)
        return ManualStep(results.draws.tokens[:len(step.seqs), 0], to_host(out.logits),
                          [slice(a, b) for a, b in zip(bounds, bounds[1:])], results)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated output to numpy; in a multi-host run only this process's copy is addressable."""
    return np.asarray(x.addressable_data(0))
