"""A draft model: a smaller model with the target's vocabulary drafts K tokens per sequence in one device call.

1. The draft model has its own KV cache with the target's page geometry and reads the target's page
   tables: a sequence's draft K/V lives in the same page ids as its target K/V, in the draft's own arrays.
   So the target's allocator, prefix cache and preemption govern both, and nothing else is kept per
   request.
2. After each target step is dispatched, `observe` dispatches a draft program on the same inputs (the
   target's `StepInputs`: its batch buffers), the tokens the target ran and its draws, still on the device
   (no host round trip):
   a. the draft model runs over the step's tokens (prompt chunks, pending tokens, drafts), writing their
      draft K/V exactly where the target wrote its own: the draft cache follows every token the target
      computes, prefill and recomputation after preemption included;
   b. only when the next step is to draft (the speculator's payoff decides, `payoff.py`): from each
      sequence's last standing token (known on the device from the target's draws) it runs K greedy
      decode steps, each a one-token ragged step over every sequence row, and returns the K tokens.
      Their K/V land in pages the scheduler reserved ahead (`Scheduler.lookahead`) and are overwritten
      by the next step's own tokens.
   Each token bucket has both programs, (a) alone and (a) with (b), compiled and timed at warm-up: their
   times are the draft model's share of a step's cost (`program_seconds`).
3. `propose` reads the drafts of the sequence rows of the last observed step (one small array copied to
   the host with the target's draws). Drafting is greedy, so the proposal is one-hot and verification is
   exact rejection sampling (`jaxserve/execution/draws.py`).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, SpeculativeConfig
from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.heads.draw import DrawBatch
from jaxserve.execution.programs import abstract
from jaxserve.execution.runner import LaunchedStep
from jaxserve.execution.step_io import StepInputs
from jaxserve.loader.load import load_sharded
from jaxserve.model.kv_cache import KVCache
from jaxserve.sampling.sampler import greedy
from jaxserve.scheduling.pages import NULL_PAGE
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.step import StepPlan
from sharding import ParallelConfig, make_plan
from sharding.loading import zeros
from sharding.rules import kv_cache_spec



class DraftModelProposer:
    decides_early = True  # the speculator decides in `observe` whether the next step drafts

    def __init__(self, name: str, model, config: ModelConfig, runner, attention, k: int):
        self.name = name
        self.num_speculative_tokens = k
        self.runner = runner  # the target's: its layouts, page geometry and compile counters
        self.events = runner.events
        self.graphdef, self.params = model.graphdef, model.params
        self.device = model.plan.mesh.devices.flat[0]
        cache = runner.cache_config
        pages = jax.ShapeDtypeStruct((config.num_kv_heads, cache.num_pages, cache.page_size, config.head_dim),
                                     model.dtype, sharding=model.plan.sharding(kv_cache_spec()))
        # Its layers are unrolled: a K and V array per layer (`KVCache`).
        self.kv_cache = jax.tree.map(lambda a: zeros(a.shape, a.dtype, a.sharding),
                                     KVCache.abstract(pages, config.num_layers, folded=False))
        # One program per (token bucket, drafting?): following the target's tokens alone, or drafting too.
        self.programs = {drafting: jax.jit(functools.partial(_draft_step, graphdef=self.graphdef,
                                                             attention=attention, config=config,
                                                             page_size=cache.page_size, k=k if drafting else 0),
                                           static_argnums=(6,), donate_argnums=(1,))
                         for drafting in (False, True)}
        self._compiled: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._seconds: dict[tuple[int, bool], float] = {}  # each compiled program's time at warm-up
        self._observed: tuple[StepPlan, jax.Array] | None = None  # the last step, its drafts [R, K] on device
        self._host_drafts: np.ndarray | None = None

    @classmethod
    def build(cls, config: SpeculativeConfig, built, runner) -> DraftModelProposer:
        """Load the draft model of `config.model` onto the first device of the target's mesh."""
        if jax.process_count() > 1 or runner.plan.pp > 1:
            raise ValueError("speculative_config: a draft model runs with a single-process target without "
                             "pipeline parallelism")
        draft_config = ModelConfig.from_pretrained(config.model)
        target = built.model_config
        if draft_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({draft_config.vocab_size}) "
                             f"differs from the target's ({target.vocab_size}); it must share the tokenizer")
        plan = make_plan(ParallelConfig(1, 1), num_layers=draft_config.num_layers, num_heads=draft_config.num_heads,
                         num_kv_heads=draft_config.num_kv_heads, devices=[runner.plan.mesh.devices.flat[0]])
        model = load_sharded(config.model, draft_config, built.dtype, plan)  # its config: how it is stored
        return cls(Path(config.model).resolve().name, model, model.config, runner, built.attention,
                   config.num_speculative_tokens)

    # ---- device side ------------------------------------------------------------------------------------

    def _inputs(self, layout: BatchLayout) -> tuple:
        """A draft program's arguments after the parameters and the cache: the target step's inputs, the
        tokens it ran [T], its draws [R, D] and how many stood [R] (R = max_num_seqs, D = draws per row)."""
        ints, floats = layout.empty()
        rows = self.runner.scheduler_config.max_num_seqs
        return (StepInputs(ints, floats), np.zeros(layout.tokens, np.int32), np.zeros((rows, layout.draws), np.int32),
                np.zeros(rows, np.int32))

    def warmup(self) -> None:
        """Compile both draft programs of every token bucket (counted as warm-up) and time each on an idle
        batch (twice, the faster counting: a program's first run pays a one-off cost)."""
        with self.events.counting(warmup=True):
            for bucket, layout in self.runner.layouts.items():
                args = abstract(self._inputs(layout))
                for drafting, program in self.programs.items():
                    self._compiled[bucket, drafting] = program.lower(abstract(self.params), abstract(self.kv_cache),
                                                                     *args, layout).compile()
        for (bucket, drafting), program in self._compiled.items():
            args = jax.device_put(self._inputs(self.runner.layouts[bucket]), self.device)
            times = []
            for _ in range(2):
                start = time.perf_counter()
                self.kv_cache, drafts = program(self.params, self.kv_cache, *args)
                drafts.block_until_ready()
                times.append(time.perf_counter() - start)
            self._seconds[bucket, drafting] = min(times)

    def program_seconds(self, bucket: int, drafting: bool) -> float:
        """Device seconds of the draft program in a step of this token bucket (0 before warm-up)."""
        return self._seconds.get((bucket, drafting), 0.0)

    def observe(self, launched: LaunchedStep, draft: bool) -> None:
        """Right after the target's step is dispatched: follow its tokens and, when the next step is to
        draft, draft from its draws."""
        layout, draws = launched.layout, launched.result.draws
        inputs = StepInputs(launched.inputs.ints, launched.inputs.floats)  # the batch: no masks, no adapters
        args = jax.device_put((inputs, launched.outputs.tokens, draws.tokens, draws.accepted), self.device)
        program = self._compiled.get((layout.tokens, draft))
        with self.events.counting():
            if program is not None:
                self.kv_cache, drafts = program(self.params, self.kv_cache, *args)
            else:
                self.kv_cache, drafts = self.programs[draft](self.params, self.kv_cache, *args, layout)
        drafts.copy_to_host_async()
        self._observed = (launched.step, drafts)
        self._host_drafts = None

    # ---- the proposer interface ---------------------------------------------------------------------------

    def prepare(self, requests: Sequence[Request]) -> None:
        pass

    def expects_drafts(self, request: Request) -> bool:
        return True

    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        if self._observed is None:
            return [[] for _ in requests]
        step, drafts = self._observed
        if self._host_drafts is None:
            self._host_drafts = np.asarray(drafts)
        rows = {seq.key: (row, seq) for row, seq in enumerate(step.seqs) if seq.samples}
        out = []
        for request in requests:
            found = rows.get(request.key)
            # Drafts continue the tokens the device knew after that step: valid while the host knows the
            # same ones (no newer step of the request, same admission).
            if found is None or found[1].epoch != request.epoch or request.num_pending:
                out.append([])
            else:
                out.append(self._host_drafts[found[0]].tolist())
        return out

    def forget(self, keys: Sequence[int]) -> None:
        pass


def _draft_step(params, kv_cache: KVCache, inputs: StepInputs, tokens, draw_tokens, accepted, layout: BatchLayout,
                *, graphdef, attention, config: ModelConfig, page_size: int, k: int):
    model = nnx.merge(graphdef, params)
    batch: DrawBatch = layout.unpack(inputs.ints, inputs.floats)
    scale = config.head_dim ** -0.5

    def forward(tokens, positions, write_index, kv, cu_q_lens, kv_lens):
        def attend(q, k_pages, v_pages, first_page):
            return attention.ragged(q, k_pages, v_pages, kv_lens, batch.page_tables + first_page, cu_q_lens,
                                    sm_scale=scale, sliding_window=config.sliding_window)

        cos, sin = model.rope(positions)
        hidden, kv = model.run_layers(model.embed(tokens), cos, sin, kv, write_index, attend)
        return model.norm(hidden), kv

    # a. The step's own tokens (as the target ran them), where the target wrote them.
    _, kv_cache = forward(tokens, batch.positions, batch.write_index, kv_cache, batch.cu_q_lens, batch.kv_lens)

    rows = accepted.shape[0]
    if k == 0:  # following the target's tokens only: the next step does not draft
        return kv_cache, jnp.zeros((rows, 0), jnp.int32)

    # b. K greedy tokens after each sequence's last standing token.
    seqs = layout.seqs
    num_drafts = jnp.zeros(seqs + 1, jnp.int32).at[jnp.where(batch.row_draft >= 0, batch.row_seq, seqs)].add(1)[:seqs]
    standing = accepted[:seqs]
    active = standing > 0
    # The first draw reads the token before the drafts; the last standing token sits `standing` after it.
    position = jnp.where(active, batch.kv_lens - 1 - num_drafts + standing, 0)
    token = jnp.take_along_axis(draw_tokens[:seqs], jnp.maximum(standing - 1, 0)[:, None], axis=1)[:, 0]
    cu_q_lens = jnp.arange(seqs + 1, dtype=jnp.int32)
    max_position = batch.page_tables.shape[1] * page_size
    out = []
    for _ in range(k):
        fits = active & (position < max_position)
        page = batch.page_tables[jnp.arange(seqs), jnp.minimum(position // page_size, batch.page_tables.shape[1] - 1)]
        write = jnp.where(fits, page * page_size + position % page_size, NULL_PAGE * page_size)
        hidden, kv_cache = forward(token, position, write, kv_cache, cu_q_lens, jnp.where(fits, position + 1, 0))
        token = greedy(model.logits(hidden))
        out.append(token)
        position = position + 1
    drafts = jnp.stack(out, axis=1)
    return kv_cache, jnp.zeros((rows, k), jnp.int32).at[:seqs].set(drafts)
