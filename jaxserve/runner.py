"""Model runner: fixed-shape batches in, pure jitted steps, one packed host array out.

1. The host wrapper turns a scheduler's work (a prefill chunk of one sequence, or a token per decode slot)
   into arrays padded to a startup bucket: positions, flat KV write slots, page tables, sampling rows.
2. A pure jitted step `(params, kv_cache, batch) -> (kv_cache, outputs)` runs the model (attention
   through the chosen backend), takes logits only where a token is sampled, and samples on device. The
   cache is donated, so XLA updates it in place.
3. `warmup` compiles every bucket before serving; the compile counter lets tests assert none follow.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.kv_cache import NULL_PAGE, KVCache, pages_needed
from jaxserve.sampling import SamplingArrays, sample, seed_words
from pallas_kernels.dispatch import AttentionBackend

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
    def __init__(self, model: nnx.Module, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype):
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.attention = attention
        self.dtype = dtype
        self.graphdef, self.params = nnx.split(model)
        self.max_pages_per_seq = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        self.kv_cache = KVCache.zeros(model_config.num_layers, model_config.num_kv_heads, cache_config.num_pages,
                                      cache_config.page_size, model_config.head_dim, dtype)
        step_kwargs = dict(graphdef=self.graphdef, attention=attention, config=model_config)
        self._prefill = jax.jit(functools.partial(_prefill_step, **step_kwargs),
                                static_argnames=("all_logits",), donate_argnums=(1,))
        self._decode = jax.jit(functools.partial(_decode_step, **step_kwargs),
                               static_argnames=("with_logits",), donate_argnums=(1,))

    # ---- host wrappers -------------------------------------------------------------------------------

    def _write_index(self, page_table: list[int], positions: np.ndarray) -> np.ndarray:
        s = self.cache_config.page_size
        table = np.asarray(page_table, np.int32)
        return table[positions // s] * s + positions % s

    def _page_row(self, pages: list[int]) -> np.ndarray:
        row = np.full(self.max_pages_per_seq, NULL_PAGE, np.int32)
        row[:len(pages)] = pages
        return row

    def prefill(self, token_ids: list[int], start: int, pages: list[int], sampling: SlotSampling,
                all_logits: bool = False):
        """Run tokens at positions start.. of one sequence; returns (next token, logits or None)."""
        n = len(token_ids)
        chunk = self.scheduler_config.bucket_for(n)
        tokens = np.zeros(chunk, np.int32)
        tokens[:n] = token_ids
        positions = start + np.arange(chunk, dtype=np.int32)
        write_index = np.zeros(chunk, np.int32)  # padding -> null page offset 0
        write_index[:n] = self._write_index(pages, positions[:n])
        batch = PrefillBatch(tokens=tokens, positions=positions, write_index=write_index,
                             page_table=self._page_row(pages), q_start=np.int32(start),
                             kv_len=np.int32(start + n), sampling=pack_sampling([sampling]))
        self.kv_cache, token, logits = self._prefill(self.params, self.kv_cache, batch, all_logits=all_logits)
        logits = np.asarray(logits)[:n] if all_logits else None
        return int(np.asarray(token)[0]), logits

    def decode(self, slots: list[tuple[int, int, list[int], SlotSampling] | None], with_logits: bool = False):
        """slots[i] = (last token, its position, pages, sampling) or None when idle.

        Returns tokens [slots] (np.int32) and, when asked, logits [slots, vocab].
        """
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
        batch = DecodeBatch(tokens=tokens, positions=positions, write_index=write_index,
                            page_tables=page_tables, lengths=lengths, sampling=pack_sampling(rows))
        self.kv_cache, out, logits = self._decode(self.params, self.kv_cache, batch, with_logits=with_logits)
        return np.asarray(out), (np.asarray(logits) if with_logits else None)

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


# ---- pure jitted steps -------------------------------------------------------------------------------

def _sm_scale(config: ModelConfig) -> float:
    return config.head_dim ** -0.5


def _prefill_step(params, kv_cache: KVCache, batch: PrefillBatch, *, graphdef, attention, config,
                  all_logits: bool):
    model = nnx.merge(graphdef, params)

    def attend(q, k_pages, v_pages):
        return attention.prefill(q, k_pages, v_pages, batch.q_start, batch.kv_len, batch.page_table,
                                 sm_scale=_sm_scale(config), sliding_window=config.sliding_window)

    hidden, kv_cache = model(batch.tokens, batch.positions, kv_cache, batch.write_index, attend)
    last = jax.lax.dynamic_slice_in_dim(hidden, batch.kv_len - batch.q_start - 1, 1)
    token = sample(model.logits(last), batch.sampling)
    logits = model.logits(hidden) if all_logits else None
    return kv_cache, token, logits


def _decode_step(params, kv_cache: KVCache, batch: DecodeBatch, *, graphdef, attention, config,
                 with_logits: bool):
    model = nnx.merge(graphdef, params)

    def attend(q, k_pages, v_pages):
        return attention.decode(q, k_pages, v_pages, batch.lengths, batch.page_tables,
                                sm_scale=_sm_scale(config), sliding_window=config.sliding_window)

    hidden, kv_cache = model(batch.tokens, batch.positions, kv_cache, batch.write_index, attend)
    logits = model.logits(hidden)
    tokens = sample(logits, batch.sampling)
    return kv_cache, tokens, (logits if with_logits else None)
