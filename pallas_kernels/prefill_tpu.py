"""Paged prefill attention for TPUs (Pallas Mosaic backend), flash-attention tiling over query blocks.

1. The wrapper lays the chunk out head-major, `[T, H, D] -> [KVH, G, T_pad, D]`, so one block
   `[G, block_q, D]` collapses to a `[G * block_q, D]` matrix without a sublane relayout (block_q is a
   power of 2 and a multiple of 16). `q_start`, `kv_len` and the page table are scalar-prefetch operands.
2. The grid is `(kv_head, query_block)`, both parallel. The K/V cache stays in HBM (`pl.ANY`).
3. A step walks the sequence's pages one compute block at a time, from the first block the sliding window
   can reach to the block holding its last real query (causal), DMA-ing block i+1 into the other half of a
   double-buffered VMEM scratch while computing on block i; the online-softmax state lives in VMEM scratch.
4. Rows at positions >= kv_len (chunk padding) see no key and come out as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import (
    check_prefill_args,
    dot_precision,
    is_pow2,
    next_pow2,
    pad_page_table,
    pick_pages_per_block,
    round_up,
)
from pallas_kernels._tpu_call import attend_paged_blocks, paged_flash_call

MIN_BLOCK_Q = 16  # a bf16 sublane tile, so [G, block_q, D] -> [G * block_q, D] is layout-free


def _prefill_kernel(meta_ref,  # [2] int32 (SMEM, scalar prefetch): q_start, kv_len
                    page_table_ref,  # [max_pages_padded] int32 (SMEM, scalar prefetch)
                    q_ref,  # [group, block_q, head_dim] (VMEM block) queries of one KV group
                    k_hbm_ref,  # [num_kv_heads, num_pages, page_size, head_dim] (HBM)
                    v_hbm_ref,  # [num_kv_heads, num_pages, page_size, head_dim] (HBM)
                    o_ref,  # [group, block_q, head_dim] (VMEM block)
                    k_buf,  # [2, pages_per_block, page_size, head_dim] VMEM double buffer
                    v_buf,  # [2, pages_per_block, page_size, head_dim]
                    sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
                    m_ref,  # [group * block_q, 1] f32 running max
                    l_ref,  # [group * block_q, 1] f32 running denominator
                    acc_ref,  # [group * block_q, head_dim] f32 running numerator
                    *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                    pages_per_block: int, precision):
    h, qi = pl.program_id(0), pl.program_id(1)
    group, block_q, head_dim = q_ref.shape
    page_size = k_buf.shape[2]
    block_k = pages_per_block * page_size
    rows = group * block_q
    max_blocks = page_table_ref.shape[0] // pages_per_block
    q_start, kv_len = meta_ref[0], meta_ref[1]

    first_q = q_start + qi * block_q
    last_q = jnp.minimum(first_q + block_q, kv_len) - 1  # last real query position of this block
    end_blk = jnp.minimum(lax.div(last_q + block_k, block_k), max_blocks)  # causal: keys <= last_q
    if sliding_window is None:
        start_blk = 0
    else:
        start_blk = lax.div(jnp.maximum(first_q - sliding_window + 1, 0), block_k)
    num_iters = jnp.where(first_q < kv_len, jnp.maximum(end_blk - start_blk, 0), 0)

    # Row r is head r // block_q, token r % block_q; block_q is a power of 2, so the token index of a row
    # is a bit-mask, not a vector remainder.
    q_pos = first_q + (lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) & (block_q - 1))
    row_ok = q_pos < kv_len

    def mask(blk):
        k_pos = blk * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        valid = row_ok & (k_pos <= q_pos) & (k_pos < kv_len)
        if sliding_window is not None:
            valid = valid & (q_pos - k_pos < sliding_window)
        return valid

    out = attend_paged_blocks(q_ref[...].reshape(rows, head_dim), lambda i: page_table_ref[i], k_hbm_ref,
                              v_hbm_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref, kv_head=h,
                              start_blk=start_blk, num_iters=num_iters, mask=mask, sm_scale=sm_scale,
                              soft_cap=soft_cap, precision=precision)
    o_ref[...] = out.reshape(group, block_q, head_dim).astype(o_ref.dtype)


def _prefill_call(q4, k_pages, v_pages, meta, page_table, *, sm_scale, soft_cap, sliding_window, block_q,
                  pages_per_block, interpret):
    num_kv_heads, group, t_pad, head_dim = q4.shape
    _, _, page_size, _ = k_pages.shape
    rows = group * block_q
    kernel = functools.partial(_prefill_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               precision=dot_precision(q4.dtype))
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i, *_: (h, 0, i, 0))
    return paged_flash_call(kernel, (meta, page_table), q4, k_pages, v_pages, grid=(num_kv_heads, t_pad // block_q),
                            q_spec=q_spec, rows=rows, pages_per_block=pages_per_block,
                            name="paged_prefill_attention_mosaic", interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "block_q",
                                             "pages_per_compute_block", "interpret"))
def paged_prefill_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, q_start: jax.Array,
                                kv_len: jax.Array, page_table: jax.Array, *, sm_scale: float,
                                soft_cap: float | None = None, sliding_window: int | None = None,
                                block_q: int | None = None, pages_per_compute_block: int | None = None,
                                interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Mosaic (TPU) paged prefill attention; same contract as `paged_prefill_attention_reference`.

    Args:
      q: [chunk, num_heads, head_dim]; row i is the token at position q_start + i.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache, with the chunk's
        own K/V already written.
      q_start: int scalar, position of the chunk's first token.
      kv_len: int scalar, q_start + number of real tokens in the chunk; rows past it are padding.
      page_table: [max_pages] int the sequence's page ids.
      sm_scale: softmax scale (static).
      soft_cap, sliding_window: optional static soft-cap and window, as for decode.
      block_q: query tokens per grid step (power of 2, >= 16; default: ~256 rows of group x block_q).
      pages_per_compute_block: pages DMA'd per loop step (default: ~128 keys).
      interpret: True (or a `pltpu.InterpretParams`, e.g. with detect_races=True) runs under TPU
        interpret mode, simulating DMAs, semaphores and VMEM on CPU.
    Returns:
      [chunk, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    check_prefill_args(q, k_pages, v_pages, q_start, kv_len, page_table, soft_cap, sliding_window)
    chunk, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    if block_q is None:
        block_q = min(max(MIN_BLOCK_Q, next_pow2(max(1, 256 // group))), next_pow2(max(chunk, MIN_BLOCK_Q)))
    if not (is_pow2(block_q) and block_q >= MIN_BLOCK_Q):
        raise ValueError(f"block_q must be a power of 2 >= {MIN_BLOCK_Q}, got {block_q}")
    ppb = pick_pages_per_block(page_size, page_table.shape[0], pages_per_compute_block, target_tokens=128)

    t_pad = round_up(chunk, block_q)
    q4 = q.reshape(chunk, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [KVH, G, T, D]
    if t_pad != chunk:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, t_pad - chunk), (0, 0)))
    meta = jnp.stack([jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)])
    out = _prefill_call(q4, k_pages, v_pages, meta, pad_page_table(page_table, ppb), sm_scale=float(sm_scale),
                        soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
                        block_q=block_q, pages_per_block=ppb, interpret=interpret)
    return out[:, :, :chunk].transpose(2, 0, 1, 3).reshape(chunk, num_heads, head_dim)
