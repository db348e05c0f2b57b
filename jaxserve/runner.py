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
4. `warmup` compiles the program of every bucket before serving; the compile counter lets tests assert
   that none follow.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.batch import BatchBuilder, BatchLayout, StepBatch
from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.kv_cache import NULL_PAGE, KVCache, pages_needed
from jaxserve.sampling import sample
from jaxserve.scheduler import ScheduledChunk, StepPlan
from jaxserve.sharded_model import ShardedModel
from pallas_kernels.dispatch import AttentionBackend
from sharding import TP_AXES, MeshPlan
from sharding.loading import zeros
from sharding.multihost import END, STEP, StepChannel
from sharding.pipeline import num_microbatches, run_pipeline
from sharding.rules import kv_cache_spec

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepOutput:
    """A dispatched step's results, still on the device."""
    plan: StepPlan | None
    samples: jax.Array  # [max_num_seqs] int32: row i is the token sampled for chunk i of the plan
    logits: jax.Array | None  # [tokens, vocab] float32, when asked for

    def tokens(self) -> np.ndarray:
        """Block until the step is done and return its samples on the host."""
        return _host(self.samples)

    def all_logits(self) -> np.ndarray:
        return _host(self.logits)


class ModelRunner:
    def __init__(self, model: ShardedModel, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype):
        self.model_config = model_config
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
        self.layouts = {b: BatchLayout(b, scheduler_config.seqs_for(b), self.max_pages_per_seq)
                        for b in scheduler_config.token_buckets}
        self.builder = BatchBuilder(scheduler_config.max_num_seqs, self.max_pages_per_seq, cache_config.page_size)
        self.channel = StepChannel()
        self.kv_cache = self._new_kv_cache()
        plan = self.plan
        rep = plan.replicated
        self._no_samples = jax.device_put(np.zeros(scheduler_config.max_num_seqs, np.int32), rep)
        self._prev_samples = self._no_samples

        kv_sharding = jax.tree.map(lambda a: a.sharding, self.kv_cache)
        kv_specs = jax.tree.map(lambda a: a.sharding.spec, self.kv_cache)
        step_kwargs = dict(graphdef=self.graphdef, attention=attention, config=model_config, pp=plan.pp,
                           num_samples=scheduler_config.max_num_seqs)

        def step(param_leaves, kv_cache, prev_samples, ints, floats, layout, with_logits):
            # check_vma=False: the outputs are replicated by construction (all-reduced or all-gathered,
            # then computed identically on every device); we do not ask JAX to prove it per value.
            local = functools.partial(_step_local, **step_kwargs, layout=layout, with_logits=with_logits)
            params = jax.tree.unflatten(param_tree, param_leaves)
            return jax.shard_map(local, mesh=plan.mesh, in_specs=(model.specs, kv_specs, P(), P(), P()),
                                 out_specs=(kv_specs, P(), P()), check_vma=False)(params, kv_cache, prev_samples,
                                                                                  ints, floats)

        # Layout and the logits flag are static (one program each) and positional: jit takes no kwargs
        # with in_shardings.
        self._step = jax.jit(step, static_argnums=(5, 6), donate_argnums=(1,),
                             in_shardings=(tuple(a.sharding for a in self._param_leaves), kv_sharding, rep, rep, rep),
                             out_shardings=(kv_sharding, rep, rep))

    def _new_kv_cache(self) -> KVCache:
        """Per layer slot: pages [pp * num_kv_heads, num_pages, page_size, head_dim], created in place."""
        c, plan = self.model_config, self.plan
        shape = (plan.pp * c.num_kv_heads, self.cache_config.num_pages, self.cache_config.page_size, c.head_dim)
        sharding = plan.sharding(kv_cache_spec())
        slots = plan.layers_per_stage
        return KVCache(k=[zeros(shape, self.dtype, sharding) for _ in range(slots)],
                       v=[zeros(shape, self.dtype, sharding) for _ in range(slots)])

    # ---- host side -------------------------------------------------------------------------------------

    def layout_for(self, num_tokens: int) -> BatchLayout:
        return self.layouts[self.scheduler_config.bucket_for(num_tokens)]

    def launch(self, plan: StepPlan, with_logits: bool = False) -> StepOutput:
        """Dispatch one step of the plan; returns without waiting for the device."""
        layout = self.layout_for(plan.num_tokens)
        ints, floats = self.builder.build(plan.chunks, layout)
        return self._lead(plan, layout, ints, floats, with_logits)

    def _lead(self, plan, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray,
              with_logits: bool) -> StepOutput:
        """Hand the step to the follower processes (multi-host), then dispatch it here."""
        self.channel.send(STEP, layout.tokens, int(with_logits), (ints, floats))
        return self._dispatch(plan, layout, ints, floats, with_logits)

    def _dispatch(self, plan, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray,
                  with_logits: bool) -> StepOutput:
        self.kv_cache, samples, logits = self._step(self._param_leaves, self.kv_cache, self._prev_samples, ints, floats,
                                                    layout, with_logits)
        self._prev_samples = samples
        samples.copy_to_host_async()  # the engine reads them next iteration; start the copy now
        return StepOutput(plan, samples, logits)

    def run(self, chunks: list[ScheduledChunk]) -> tuple[np.ndarray, np.ndarray, list[slice]]:
        """One step with every row's logits, waited for (research, tests): (the token sampled after each
        chunk [n], logits [tokens, vocab], the rows of each chunk). Not while the engine has requests
        running: their next step would read this step's samples as their pending tokens."""
        out = self.launch(StepPlan(chunks, sum(c.num_tokens for c in chunks)), with_logits=True)
        bounds = np.cumsum([0] + [c.num_tokens for c in chunks])
        return out.tokens()[:len(chunks)], out.all_logits(), [slice(a, b) for a, b in zip(bounds, bounds[1:])]

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
            ints, floats = self.channel.receive_batch(layout.empty())
            self._dispatch(None, layout, np.asarray(ints), np.asarray(floats), bool(flag))
            steps += 1

    def warmup(self) -> float:
        """Compile the step of every token bucket; returns seconds spent."""
        start = time.perf_counter()
        layouts = list(self.layouts.values())
        with tqdm(total=len(layouts), desc="Compiling", unit="program") as bar:
            for layout in layouts:
                # No sequences: every token writes to the null page, so real cache pages stay untouched.
                self._lead(None, layout, *layout.empty(), with_logits=False).tokens()
                bar.update()
        self._prev_samples = self._no_samples
        elapsed = time.perf_counter() - start
        logger.info("warm-up compiled %d step programs (token buckets %s) in %.1fs", len(layouts),
                    ",".join(map(str, self.layouts)), elapsed)
        return elapsed


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


def _step_local(params, kv_cache: KVCache, prev_samples, ints, floats, *, graphdef, attention, config, pp,
                num_samples: int, layout: BatchLayout, with_logits: bool):
    model = nnx.merge(graphdef, params)
    batch: StepBatch = layout.unpack(ints, floats)
    # Tokens sampled by the previous step that the host has not seen yet come straight from the device.
    tokens = jnp.where(batch.from_prev >= 0, prev_samples[jnp.maximum(batch.from_prev, 0)], batch.tokens)
    num_tokens = layout.tokens
    m = num_microbatches(num_tokens, pp)
    size = num_tokens // m
    split = lambda a: a.reshape(m, size)
    tokens, positions, write_index = split(tokens), split(batch.positions), split(batch.write_index)

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])
        cu_q_lens, kv_lens = _microbatch_view(batch.cu_q_lens, batch.kv_lens, micro * size, size)

        def attend(q, k_pages, v_pages):
            return attention.ragged(q, k_pages, v_pages, kv_lens, batch.page_tables, cu_q_lens,
                                    sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window)

        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES)

    hidden, kv_cache = run_pipeline(stage, lambda i: model.embed(tokens[i], TP_AXES), m, kv_cache, pp)
    hidden = model.norm(hidden.reshape(num_tokens, -1))
    samples = sample(model.logits(hidden[batch.sample_index], TP_AXES), batch.sampling)
    samples = jnp.zeros(num_samples, jnp.int32).at[:layout.seqs].set(samples)
    logits = model.logits(hidden, TP_AXES) if with_logits else None
    return kv_cache, samples, logits
