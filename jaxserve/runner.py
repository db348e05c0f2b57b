"""Model runner: fixed-shape batches in, pure jitted steps over the device mesh, one packed host array out.

1. The host wrapper turns a scheduler's work (a prefill chunk of one sequence, or a token per decode slot)
   into arrays padded to a startup bucket: positions, flat KV write slots, page tables, sampling rows.
   In a multi-host run the leader broadcasts that batch first, and the other processes (`follow`) run
   the same step on it.
2. A pure jitted step `(params, kv_cache, batch) -> (kv_cache, outputs)` is one `shard_map` over the mesh
   (even a one-device mesh: one code path). Each device runs its pipeline stage's layers on its tensor
   shards (`sharding/pipeline.py` passes microbatches between stages), attention through the chosen
   backend on local heads; logits are gathered and every device samples identically. The jit has
   explicit in/out shardings, so nothing recompiles for a sharding it had not seen, and the cache is
   donated, so XLA updates it in place.
3. `warmup` compiles every bucket before serving; the compile counter lets tests assert none follow.
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

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.kv_cache import NULL_PAGE, KVCache, pages_needed
from jaxserve.sampling import SamplingArrays, sample, seed_words
from jaxserve.sharded_model import ShardedModel
from pallas_kernels.dispatch import AttentionBackend
from sharding import TP_AXES, MeshPlan
from sharding.loading import zeros
from sharding.multihost import DECODE, END, PREFILL, StepChannel
from sharding.pipeline import num_microbatches, run_pipeline
from sharding.rules import kv_cache_spec

logger = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
    tokens: jax.Array  # [chunk] int32, padded with 0
    positions: jax.Array  # [chunk] int32
    write_index: jax.Array  # [chunk] int32 flat KV slot; padding -> the null page
    page_table: jax.Array  # [max_pages] int32
    q_start: jax.Array  # [] int32 position of tokens[0]
    kv_len: jax.Array  # [] int32 q_start + number of real tokens
    sampling: SamplingArrays  # [1] rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeBatch:
    tokens: jax.Array  # [slots] int32 last token of each slot (0 when idle)
    positions: jax.Array  # [slots] int32 position of that token
    write_index: jax.Array  # [slots] int32 flat KV slot; idle -> the null page
    page_tables: jax.Array  # [slots, max_pages] int32
    lengths: jax.Array  # [slots] int32 tokens in cache after this step; 0 = idle
    sampling: SamplingArrays  # [slots] rows


@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Host view of one row of SamplingArrays."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0


def pack_sampling(rows: list[SlotSampling | None]) -> SamplingArrays:
    idle = SlotSampling()
    rows = [r or idle for r in rows]
    return SamplingArrays(
        temperature=np.array([r.temperature for r in rows], np.float32),
        top_k=np.array([r.top_k for r in rows], np.int32),
        top_p=np.array([r.top_p for r in rows], np.float32),
        min_p=np.array([r.min_p for r in rows], np.float32),
        seed=np.array([seed_words(r.seed) for r in rows], np.uint32).reshape(len(rows), 2),
        step=np.array([r.step for r in rows], np.int32),
    )


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
        self.max_pages_per_seq = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        self.channel = StepChannel()
        self.kv_cache = self._new_kv_cache()

        plan = self.plan
        kv_sharding = jax.tree.map(lambda a: a.sharding, self.kv_cache)
        kv_specs = jax.tree.map(lambda a: a.sharding.spec, self.kv_cache)
        rep = plan.replicated
        step_kwargs = dict(graphdef=self.graphdef, attention=attention, config=model_config, pp=plan.pp)

        def sharded(local, **static):
            # check_vma=False: the outputs are replicated by construction (all-reduced or all-gathered,
            # then computed identically on every device); we do not ask JAX to prove it per value.
            return jax.shard_map(functools.partial(local, **step_kwargs, **static), mesh=plan.mesh,
                                 in_specs=(model.specs, kv_specs, P()), out_specs=(kv_specs, P(), P()),
                                 check_vma=False)

        def prefill(params, kv_cache, batch, all_logits):
            return sharded(_prefill_local, all_logits=all_logits)(params, kv_cache, batch)

        def decode(params, kv_cache, batch, with_logits):
            return sharded(_decode_local, with_logits=with_logits)(params, kv_cache, batch)

        shardings = dict(in_shardings=(model.shardings, kv_sharding, rep), out_shardings=(kv_sharding, rep, rep),
                         donate_argnums=(1,))
        # The flag is static (a different program) and positional: jit takes no kwargs with in_shardings.
        self._prefill = jax.jit(prefill, static_argnums=(3,), **shardings)
        self._decode = jax.jit(decode, static_argnums=(3,), **shardings)

    def _new_kv_cache(self) -> KVCache:
        """Per layer slot: pages [pp * num_kv_heads, num_pages, page_size, head_dim], created in place."""
        c, plan = self.model_config, self.plan
        shape = (plan.pp * c.num_kv_heads, self.cache_config.num_pages, self.cache_config.page_size, c.head_dim)
        sharding = plan.sharding(kv_cache_spec())
        slots = plan.layers_per_stage
        return KVCache(k=[zeros(shape, self.dtype, sharding) for _ in range(slots)],
                       v=[zeros(shape, self.dtype, sharding) for _ in range(slots)])

    # ---- host wrappers -------------------------------------------------------------------------------

    def _write_index(self, page_table: list[int], positions: np.ndarray) -> np.ndarray:
        s = self.cache_config.page_size
        table = np.asarray(page_table, np.int32)
        return table[positions // s] * s + positions % s

    def _page_row(self, pages: list[int]) -> np.ndarray:
        row = np.full(self.max_pages_per_seq, NULL_PAGE, np.int32)
        row[:len(pages)] = pages
        return row

    def _prefill_batch(self, token_ids: list[int], start: int, pages: list[int],
                       sampling: SlotSampling) -> PrefillBatch:
        n = len(token_ids)
        chunk = self.scheduler_config.bucket_for(n)
        tokens = np.zeros(chunk, np.int32)
        tokens[:n] = token_ids
        positions = start + np.arange(chunk, dtype=np.int32)
        write_index = np.zeros(chunk, np.int32)  # padding -> null page offset 0
        write_index[:n] = self._write_index(pages, positions[:n])
        return PrefillBatch(tokens=tokens, positions=positions, write_index=write_index,
                            page_table=self._page_row(pages), q_start=np.int32(start),
                            kv_len=np.int32(start + n), sampling=pack_sampling([sampling]))

    def _decode_batch(self, slots) -> DecodeBatch:
        b = self.scheduler_config.max_num_seqs
        assert len(slots) == b, f"decode takes exactly {b} slots"
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        write_index = np.zeros(b, np.int32)
        page_tables = np.full((b, self.max_pages_per_seq), NULL_PAGE, np.int32)
        lengths = np.zeros(b, np.int32)
        rows = []
        for i, slot in enumerate(slots):
            if slot is None:
                rows.append(None)
                continue
            token, position, pages, sampling = slot
            tokens[i], positions[i], lengths[i] = token, position, position + 1
            page_tables[i, :len(pages)] = pages
            write_index[i] = self._write_index(pages, np.array([position]))[0]
            rows.append(sampling)
        return DecodeBatch(tokens=tokens, positions=positions, write_index=write_index,
                           page_tables=page_tables, lengths=lengths, sampling=pack_sampling(rows))

    def prefill(self, token_ids: list[int], start: int, pages: list[int], sampling: SlotSampling,
                all_logits: bool = False):
        """Run tokens at positions start.. of one sequence; returns (next token, logits or None)."""
        n = len(token_ids)
        batch = self._prefill_batch(token_ids, start, pages, sampling)
        self.channel.send(PREFILL, len(batch.tokens), int(all_logits), batch)
        self.kv_cache, token, logits = self._prefill(self.params, self.kv_cache, batch, all_logits)
        logits = _host(logits)[:n] if all_logits else None
        return int(_host(token)[0]), logits

    def decode(self, slots: list[tuple[int, int, list[int], SlotSampling] | None], with_logits: bool = False):
        """slots[i] = (last token, its position, pages, sampling) or None when idle.

        Returns tokens [slots] (np.int32) and, when asked, logits [slots, vocab].
        """
        batch = self._decode_batch(slots)
        self.channel.send(DECODE, len(slots), int(with_logits), batch)
        self.kv_cache, out, logits = self._decode(self.params, self.kv_cache, batch, with_logits)
        return _host(out), (_host(logits) if with_logits else None)

    # ---- multi-host ---------------------------------------------------------------------------------

    def end_call(self) -> None:
        """Leader: tell the followers that this burst of steps is over (they return from `follow`)."""
        self.channel.send(END)

    def follow(self) -> int:
        """Follower: run the leader's steps, in order, until it ends the burst. Returns steps run."""
        steps = 0
        while True:
            kind, size, flag = self.channel.receive_header()
            if kind == END:
                return steps
            if kind == PREFILL:
                null_pages = [NULL_PAGE] * pages_needed(size, self.cache_config.page_size)
                template = self._prefill_batch([0] * size, 0, null_pages, SlotSampling())
                batch = self.channel.receive_batch(template)
                self.kv_cache, _, _ = self._prefill(self.params, self.kv_cache, batch, bool(flag))
            elif kind == DECODE:
                batch = self.channel.receive_batch(self._decode_batch([None] * size))
                self.kv_cache, _, _ = self._decode(self.params, self.kv_cache, batch, bool(flag))
            else:
                raise RuntimeError(f"unknown step kind {kind} from the leader")
            steps += 1

    def warmup(self) -> float:
        """Compile the decode step and every prefill bucket; returns seconds spent."""
        start = time.perf_counter()
        buckets = self.scheduler_config.prefill_buckets
        idle = [None] * self.scheduler_config.max_num_seqs
        with tqdm(total=len(buckets) + 1, desc="Compiling", unit="program") as bar:
            # Idle rows and null pages: the programs compile without touching real cache pages.
            self.decode(idle)
            bar.update()
            for bucket in buckets:
                null_pages = [NULL_PAGE] * pages_needed(bucket, self.cache_config.page_size)
                self.prefill([0] * bucket, 0, null_pages, SlotSampling())
                bar.update()
        elapsed = time.perf_counter() - start
        logger.info("warm-up compiled %d programs in %.1fs", len(buckets) + 1, elapsed)
        return elapsed


def _host(x: jax.Array) -> np.ndarray:
    """A replicated output to numpy; in a multi-host run only this process's copy is addressable."""
    return np.asarray(x.addressable_data(0))


# ---- pure jitted steps (bodies of the shard_map: every array here is this device's shard) -----------

def _sm_scale(config: ModelConfig) -> float:
    return config.head_dim ** -0.5


def _microbatches(x: jax.Array, m: int) -> jax.Array:
    return x.reshape((m, x.shape[0] // m) + x.shape[1:])


def _null_writes(write_index: jax.Array, valid: jax.Array) -> jax.Array:
    # A pipeline bubble step computes on filler data: send its K/V to the null page.
    return jnp.where(valid, write_index, NULL_PAGE)


def _prefill_local(params, kv_cache: KVCache, batch: PrefillBatch, *, graphdef, attention, config, pp,
                   all_logits: bool):
    model = nnx.merge(graphdef, params)
    chunk = batch.tokens.shape[0]
    m = num_microbatches(chunk, pp)
    size = chunk // m
    tokens, positions, write_index = (_microbatches(a, m) for a in (batch.tokens, batch.positions,
                                                                   batch.write_index))

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])

        def attend(q, k_pages, v_pages):
            # Microbatch `micro` holds positions q_start + micro * size ...; causal masking over kv_len
            # ignores later microbatches' slots, which this layer has not written yet.
            return attention.prefill(q, k_pages, v_pages, batch.q_start + micro * size, batch.kv_len,
                                     batch.page_table, sm_scale=_sm_scale(config),
                                     sliding_window=config.sliding_window)

        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES)

    hidden, kv_cache = run_pipeline(stage, lambda i: model.embed(tokens[i], TP_AXES), m, kv_cache, pp)
    hidden = model.norm(hidden.reshape(chunk, -1))
    last = jax.lax.dynamic_slice_in_dim(hidden, batch.kv_len - batch.q_start - 1, 1)
    token = sample(model.logits(last, TP_AXES), batch.sampling)
    logits = model.logits(hidden, TP_AXES) if all_logits else None
    return kv_cache, token, logits


def _decode_local(params, kv_cache: KVCache, batch: DecodeBatch, *, graphdef, attention, config, pp,
                  with_logits: bool):
    model = nnx.merge(graphdef, params)
    slots = batch.tokens.shape[0]
    m = num_microbatches(slots, pp)
    tokens, positions, write_index, lengths, page_tables = (
        _microbatches(a, m) for a in (batch.tokens, batch.positions, batch.write_index, batch.lengths,
                                      batch.page_tables))

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])

        def attend(q, k_pages, v_pages):
            return attention.decode(q, k_pages, v_pages, lengths[micro], page_tables[micro],
                                    sm_scale=_sm_scale(config), sliding_window=config.sliding_window)

        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES)

    hidden, kv_cache = run_pipeline(stage, lambda i: model.embed(tokens[i], TP_AXES), m, kv_cache, pp)
    logits = model.logits(model.norm(hidden.reshape(slots, -1)), TP_AXES)
    tokens = sample(logits, batch.sampling)
    return kv_cache, tokens, (logits if with_logits else None)
