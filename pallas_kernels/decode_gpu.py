"""Paged decode attention for GPUs, written for Pallas' Triton backend.

1. The wrapper groups the query heads by KV head (`[B, H, D] -> [B, KVH, G, D]`) and pads the group to at
   least 16 rows (a power of 2), the smallest M that Triton's `dot` accepts.
2. The grid is `(batch, kv_head)`: one program owns one slot's query group and one KV head, so each K/V page
   is read from HBM once per group rather than once per query head (GQA inside the kernel).
3. The program walks the slot's page-table row one compute block (`pages_per_compute_block` pages) at a
   time, gathering the pages straight from the paged cache, and keeps an online softmax in float32.
   Blocks wholly before the sliding window or past `lengths[b]` are never loaded; the tail is masked.
4. An idle slot (length 0) runs no iteration and writes zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._paged_common import (
    MASK_VALUE,
    block_scores,
    check_decode_args,
    dot_precision,
    is_pow2,
    next_pow2,
    online_softmax_step,
    pad_page_table,
    pick_pages_per_block,
)

MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16


def _decode_kernel(lengths_ref,  # [batch] int32, whole array
                   page_table_ref,  # [max_pages_padded] int32, this slot's row
                   q_ref,  # [group_pad, head_dim], this slot's queries of one KV group
                   k_ref,  # [num_pages, page_size, head_dim], this KV head's pages
                   v_ref,  # [num_pages, page_size, head_dim]
                   o_ref,  # [group_pad, head_dim]
                   *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                   pages_per_block: int, precision):
    _, page_size, head_dim = k_ref.shape
    block_k = pages_per_block * page_size
    max_blocks = page_table_ref.shape[0] // pages_per_block
    length = lengths_ref[pl.program_id(0)]

    end_blk = jnp.minimum(lax.div(length + block_k - 1, block_k), max_blocks)
    if sliding_window is None:
        start_blk = 0
    else:  # the new token at length-1 sees keys at positions >= length - window
        start_blk = lax.div(jnp.maximum(length - sliding_window, 0), block_k)

    q = q_ref[...]
    rows = q.shape[0]

    def body(i, carry):
        acc, m_prev, l_prev = carry
        blk = start_blk + i
        page_ids = page_table_ref[pl.ds(blk * pages_per_block, pages_per_block)]
        k = k_ref[page_ids].reshape(block_k, head_dim)
        v = v_ref[page_ids].reshape(block_k, head_dim)
        s = block_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
        pos = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)
        valid = pos < length
        if sliding_window is not None:
            valid = valid & (pos >= length - sliding_window)
        valid = lax.broadcast_in_dim(valid, (rows, block_k), (1,))
        return online_softmax_step(acc, m_prev, l_prev, s, valid, v, precision)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, _, l = lax.fori_loop(0, jnp.maximum(end_blk - start_blk, 0), body, init)
    # Idle slots (and padded rows) never accumulate: l == 0 -> output 0, not NaN.
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def _decode_call(q4, k_pages, v_pages, lengths, page_tables, *, sm_scale, soft_cap, sliding_window,
                 pages_per_block, num_warps, num_stages, interpret):
    batch, num_kv_heads, rows, head_dim = q4.shape
    _, num_pages, page_size, _ = k_pages.shape
    max_pages = page_tables.shape[1]
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               precision=dot_precision(q4.dtype))
    kv_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h: (h, 0, 0, 0))
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads),
        in_specs=[
            pl.BlockSpec((batch,), lambda b, h: (0,)),
            pl.BlockSpec((None, max_pages), lambda b, h: (b, 0)),
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention_triton",
    )(lengths, page_tables, q4, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "pages_per_compute_block",
                                             "num_warps", "num_stages", "interpret"))
def paged_decode_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                               page_tables: jax.Array, *, sm_scale: float, soft_cap: float | None = None,
                               sliding_window: int | None = None, pages_per_compute_block: int | None = None,
                               num_warps: int = 4, num_stages: int = 2, interpret: bool = False) -> jax.Array:
    """Triton paged decode attention; same contract as `paged_decode_attention_reference`.

    Args:
      q: [batch, num_heads, head_dim] queries; the token of slot b sits at position lengths[b] - 1.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache.
      lengths: [batch] int number of valid cached tokens per slot, the new one included; 0 = idle slot.
      page_tables: [batch, max_pages] int page ids per slot (padding entries point at the null page 0).
      sm_scale: softmax scale (static).
      soft_cap: optional static logit soft-cap (cap * tanh(s / cap)).
      sliding_window: optional static window; keys with q_pos - k_pos < window are attended.
      pages_per_compute_block: pages gathered per loop step (default: ~128 keys, at least 16).
      num_warps, num_stages: Triton launch options.
      interpret: run in Pallas interpret mode (CPU testing).
    Returns:
      [batch, num_heads, head_dim] in q's dtype; zeros for idle slots.
    """
    check_decode_args(q, k_pages, v_pages, lengths, page_tables, soft_cap, sliding_window)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    # Triton tensors must have power-of-2 sizes; interpret mode (CPU) has no such limit, so tiny test
    # models (head_dim 8) can still run the kernel's logic there.
    if not interpret and not (is_pow2(page_size) and is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"the Triton kernel needs a power-of-2 page_size and head_dim >= 16, "
                         f"got page_size={page_size}, head_dim={head_dim}")
    group = num_heads // num_kv_heads
    rows = max(MIN_DOT_ROWS, next_pow2(group))
    ppb = pick_pages_per_block(page_size, page_tables.shape[1], pages_per_compute_block, target_tokens=128,
                               min_tokens=MIN_DOT_ROWS)
    if not interpret and not is_pow2(ppb):
        raise ValueError(f"pages_per_compute_block must be a power of 2 for Triton, got {ppb}")
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    out = _decode_call(q4, k_pages, v_pages, lengths.astype(jnp.int32), pad_page_table(page_tables, ppb),
                       sm_scale=float(sm_scale), soft_cap=None if soft_cap is None else float(soft_cap),
                       sliding_window=sliding_window, pages_per_block=ppb, num_warps=num_warps,
                       num_stages=num_stages, interpret=interpret)
    return out[:, :, :group].reshape(batch, num_heads, head_dim)
