"""Model runner: the device state of one model, and the step launched on it asynchronously.

1. The runner holds what the step program runs on: the parameters (as a flat tuple of leaves) and one
   `StepState` (`step_io.py`: the paged KV cache, zero-filled on a thread while warm-up compiles; the
   previous step's samples; the output head's state), all on the mesh. Each step takes the state
   donated and hands back the next one.
2. `launch(step, masks)` packs the plan into the device batch of the smallest token bucket with a ready
   program (`batch.py`, `compiler.py`) and dispatches `step(params, state, inputs)` without waiting for
   it. The grammar masks of the plan's rows (when some draw is constrained) go in the inputs of the same
   program, where the output head takes them.
3. The samples stay on the device and feed the next step; `LaunchedStep.read()` copies the head's result
   to the host (its copy started at launch) when the engine gets round to it, a step later. It notes when
   it arrived and whether the host had to wait for it: the engine's step-time measurements
   (`jaxserve/scheduling/step_cost.py`). `time_idle_step` times a bucket's program at warm-up, and
   `run_warmup_batches` runs it once through its loops and branches.
   A vision model's steps also carry the encoder rows of their image tokens (`image_rows.py`), gathered from
   the encoder cache at launch; a step without images reads a blank kept on the device.
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
from jaxserve.execution.heads.draw import DrawHead, DrawResults
from jaxserve.execution.image_rows import EncoderRows, EncoderRowsBuilder
from jaxserve.execution.programs import StepPrograms
from jaxserve.execution.step_io import OutputHead, StepInputs, StepOutputs, StepState, to_host
from jaxserve.loader.placement import ShardedModel
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.slots import LoRASlots
from jaxserve.model.kv_cache import KVCache
from jaxserve.scheduling.pages import pages_needed
from jaxserve.scheduling.step import StepPlan
from pallas_kernels.dispatch import AttentionBackend
from sharding import MeshPlan
from sharding.loading import zeros


@dataclasses.dataclass
class ManualStep:
    """`ModelRunner.run`'s answer, on the host."""
    samples: np.ndarray  # [seqs] the token drawn after each sequence's span (its first draw)
    logits: np.ndarray  # [tokens, vocab] float32, every row's
    rows: list[slice]  # each sequence's rows of `logits`
    results: DrawResults  # everything else the step returned (logprobs), as numpy


@dataclasses.dataclass
class LaunchedStep:
    """A dispatched step, its outputs still on the device."""
    step: StepPlan | None
    layout: BatchLayout  # its program's shapes, and the output head (`layout.head`)
    inputs: StepInputs  # what it ran on (the batch buffers as sent): a draft model follows them
    outputs: StepOutputs
    launched_at: float = 0.0  # time.perf_counter() at dispatch
    done_at: float | None = None  # when the host had its result (set by `read`)
    waited: bool = False  # the host blocked for it: `done_at` is when the device finished

    @property
    def bucket(self) -> int:
        """The token bucket whose program runs it."""
        return self.layout.tokens

    @property
    def result(self):
        """The output head's result, on the device."""
        return self.outputs.head

    def read(self):
        """Block until the step is done; the head's result on the host (`OutputHead.read`)."""
        head: OutputHead = self.layout.head
        self.waited = not head.ready(self.result)
        out = head.read(self.result, self.step)
        self.done_at = time.perf_counter()
        return out


class ModelRunner:
    def __init__(self, model: ShardedModel, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype,
                 sampler_config: SamplerConfig = SamplerConfig(), events: CompileEvents | None = None,
                 head: OutputHead | None = None, lora: LoRASlots | None = None, max_drafts: int = 0,
                 compiler_options: dict | None = None, plain_programs: bool = False,
                 image_rows: EncoderRowsBuilder | None = None):
        """`head`: what the steps produce (`heads/`; default: the draw head); `lora`: the LoRA adapters'
        device slots (`enable_lora`); `max_drafts`: draft tokens a sequence may verify per step (speculative
        decoding; 0: off); `compiler_options`: XLA options of the step programs (`cpu_matmuls.py`);
        `plain_programs`: with `max_drafts`, a second program per bucket for the steps that verify no drafts
        (`compiler.py`); `image_rows`: a vision model's encoder and the rows it places in each step
        (`image_rows.py`)."""
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
        self.head = head or DrawHead(sampler_config.max_logprobs)
        self.programs = StepPrograms.build(model, model_config, cache_config, scheduler_config, attention, dtype,
                                           sampler_config, self.head, None if lora is None else lora.stack,
                                           max_drafts, compiler_options, plain_programs, image_rows)
        self.image_rows = image_rows
        self.max_pages_per_seq = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        self.builder = BatchBuilder(max_seqs, self.max_pages_per_seq, cache_config.page_size)
        # The cache's pages are filled with zeros on a thread: on CPU that is a pass over fresh memory
        # (1 GB for a 1B model: ~1 s), which then overlaps warm-up's first compilation. Compiling needs only
        # the abstract cache; the first access to `kv_cache` waits for the arrays.
        self.kv_abstract = self.programs.kv_cache
        self._state: StepState | None = None
        filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-kv-cache")
        self._state_filling = filler.submit(self._new_state)
        filler.shutdown(wait=False)
        rep = self.plan.replicated
        # The allowed-token bitmask of each bucket's sequence rows when no row is constrained: all ones, kept
        # on the device, so unconstrained steps transfer nothing for it (for a head that takes masks).
        self.mask_words = self.programs.mask_words
        self._open_masks = {b: jax.device_put(self._all_allowed(layout.seqs), rep)
                            for b, layout in self.programs.layouts.items()} if self.head.takes_masks else {}
        self.compiler = StepCompiler(self.programs.step, self.programs.layouts, self.programs.inputs,
                                     (self.graphdef, attention, model_config, self.plan.pp, self.plan.mesh.device_ids,
                                      max_seqs, self.head, sorted((compiler_options or {}).items())),
                                     list(self.plan.mesh.devices.flat), max_seqs, self.events,
                                     self.programs.plain_layouts)

    def _new_state(self) -> StepState:
        """The state's arrays, zeros created in place on their devices (the sampler state has a row per slot
        and a scratch row for padding: jaxserve/sampling/logits.py)."""
        return jax.tree.map(_zeros_of, self.programs.state)

    @property
    def state(self) -> StepState:
        """What the next step takes donated (the first access waits for the cache's zeros)."""
        if self._state is None:
            self._state = self._state_filling.result()
        return self._state

    @property
    def kv_cache(self) -> KVCache:
        return self.state.kv_cache

    @property
    def sampler_state(self):
        """The draw head's sampler state (None for a head without one)."""
        return self.state.head

    def forget_samples(self) -> None:
        """The previous step was warm-up's or a timing's: no request reads its samples (fresh zeros, since
        the samples are donated with the rest of the state)."""
        self._state = dataclasses.replace(self.state, samples=_zeros_of(self.programs.state.samples))

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
        # The vision encoder's programs, after the steps' warm-up batches: compiled before them, its bucket-1
        # program was traced again at the first image under the Pallas Triton kernel in interpret mode on CPU
        # (no global config changed; the cause is in the interpret mode's tracing context).
        if self.image_rows is not None and self.image_rows.encoder is not None:
            with self.events.counting(warmup=True):
                self.image_rows.encoder.warmup()
        self.state  # noqa: B018 - the cache was being filled, meanwhile, on its thread
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
        layout = self.compiler.layout_for(step.num_tokens, verifies=step.verifies_drafts)
        ints, floats = self.builder.build(step, layout)
        if masks is not None:  # the plan's rows, then all-allowed padding rows up to the layout's
            masks = np.concatenate([masks, self._all_allowed(layout.seqs - len(masks))])
        images = None
        if self.image_rows is not None:  # encoding a step's new images compiles nothing after warm-up
            with self.events.counting():
                images = self.image_rows.gather(step, layout.tokens)
        return self.dispatch(step, layout, ints, floats, masks, with_logits, images)

    def dispatch(self, step: StepPlan | None, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray,
                  masks: np.ndarray | None, with_logits: bool, images: EncoderRows | None = None) -> LaunchedStep:
        """Run `layout`'s program on the packed batch; `images`: a vision model's encoder rows on the host
        (`EncoderRowsBuilder.gather`; None: the step has no image token)."""
        # Masks go in as committed device arrays either way: a host array would be another program to compile.
        if not self.head.takes_masks:
            masks = None
        elif masks is None:
            masks = self._open_masks[layout.tokens]
        else:
            masks = jax.device_put(masks, self.plan.replicated)
        if self.image_rows is not None:
            images = self.image_rows.place(images, layout.tokens)
        inputs = StepInputs(ints, floats, masks, None if self.lora is None else self.lora.stack, images)
        launched_at = time.perf_counter()
        with self.events.counting():
            self._state, outputs = self.compiler.program(layout, with_logits)(self._param_leaves, self.state, inputs)
        self.head.copy_to_host(outputs.head)  # the engine reads it next iteration; start the copy now
        return LaunchedStep(step, layout, inputs, outputs, launched_at=launched_at)

    def time_idle_step(self, bucket: int, verify: bool = False) -> float:
        """Seconds one step of `bucket`'s ready program takes, dispatch to samples on the host, with no
        sequence in it (every token writes to the null page); with `verify`, greedy sequences verifying a
        draft each, on the null page too (the programs' draft rows: `BatchBuilder.warmup`). Only while no
        request runs."""
        layout = self.compiler.bucket_layouts(bucket)[0 if verify else -1]
        batch = self.builder.warmup(layout, every_option=False, verify=True) if verify else layout.empty()
        start = time.perf_counter()
        jax.block_until_ready(self.dispatch(None, layout, *batch, None, with_logits=False).outputs)
        seconds = time.perf_counter() - start
        self.forget_samples()
        return seconds

    def run_warmup_batches(self, bucket: int) -> None:
        """Run `bucket`'s program on the builder's warm-up batches (greedy, then every option) and wait: the
        first runs of its loops and branches are paid here rather than by the first requests. Only while
        no request runs."""
        for layout in self.compiler.bucket_layouts(bucket):
            for every_option in (False, True):
                ints, floats = self.builder.warmup(layout, every_option)
                masks = self._all_allowed(layout.seqs) if every_option else None
                images = (self.image_rows.warmup(layout.tokens) if self.image_rows is not None and every_option
                          else None)
                jax.block_until_ready(self.dispatch(None, layout, ints, floats, masks, False, images).outputs)
        self.forget_samples()

    def run(self, step: StepPlan, masks: np.ndarray | None = None) -> ManualStep:
        """One step with every row's logits, waited for (research, tests). Not while the engine has
        requests running: their next step would read this step's samples as their pending tokens.
        `masks`: allowed-token bitmasks of the plan's draws; the logits stay unmasked."""
        out = self.launch(step, masks=masks, with_logits=True)
        bounds = np.cumsum([0] + [seq.num_tokens for seq in step.seqs])
        results = jax.tree.map(to_host, out.result)
        return ManualStep(results.draws.tokens[:len(step.seqs), 0], to_host(out.outputs.logits),
                          [slice(a, b) for a, b in zip(bounds, bounds[1:])], results)


def _zeros_of(abstract: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of an abstract state array, created in place on its devices."""
    return zeros(abstract.shape, abstract.dtype, abstract.sharding)
