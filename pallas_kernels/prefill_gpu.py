"""Paged prefill attention for GPUs (flash-attention tiling), written for Pallas' Triton backend.

1. The wrapper views the chunk's queries as `[T, KVH, G, D]` (G query heads per KV head, padded to a power of
   2) and pads T to a multiple of the query block, so every block is full.
2. The grid is `(kv_head, query_block)`. One program loads `block_q` tokens x G heads as one
   `[block_q * G, D]` matrix: the rows of a whole KV group share every K/V tile it reads.
3. It walks the sequence's page table one compute block (`pages_per_compute_block` pages) at a time, from
   the first block the sliding window can reach up to the block holding its last query (causal), with an
   online softmax in float32; keys past the query's position or `kv_len` are masked.
4. Rows at positions >= kv_len (chunk padding) see no key and come out as zeros.
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
    check_prefill_args,
    dot_precision,
    is_pow2,
    next_pow2,
    online_softmax_step,
    pad_page_table,
    pick_pages_per_block,
    round_up,
)

MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16


def _prefill_kernel(meta_ref,  # [2] int32: q_start, kv_len
                    page_table_ref,  # [max_pages_padded] int32
                    q_ref,  # [block_q, group_pad, head_dim] queries of one KV group
                    k_ref,  # [num_pages, page_size, head_dim], this KV head's pages
                    v_ref,  # [num_pages, page_size, head_dim]
                    o_ref,  # [block_q, group_pad, head_dim]
                    *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                    pages_per_block: int, precision):
    block_q, group, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    max_blocks = page_table_ref.shape[0] // pages_per_block
    rows = block_q * group
    q_start = meta_ref[0]
    kv_len = meta_ref[1]

    first_q = q_start + pl.program_id(1) * block_q
    last_q = jnp.minimum(first_q + block_q, kv_len) - 1  # last real query position of this block
    end_blk = jnp.minimum(lax.div(last_q + block_k, block_k), max_blocks)  # causal: keys <= last_q
    if sliding_window is None:
        start_blk = 0
    else:
        start_blk = lax.div(jnp.maximum(first_q - sliding_window + 1, 0), block_k)
    num_iters = jnp.where(first_q < kv_len, jnp.maximum(end_blk - start_blk, 0), 0)

    q = q_ref[...].reshape(rows, head_dim)  # row r is token r // group, head r % group
    q_pos = first_q + lax.div(jnp.arange(rows, dtype=jnp.int32), group)
    q_pos_2d = lax.broadcast_in_dim(q_pos, (rows, block_k), (0,))
    row_ok = lax.broadcast_in_dim(q_pos < kv_len, (rows, block_k), (0,))

    def body(i, carry):
        acc, m_prev, l_prev = carry
        blk = start_blk + i
        page_ids = page_table_ref[pl.ds(blk * pages_per_block, pages_per_block)]
        k = k_ref[page_ids].reshape(block_k, head_dim)
        v = v_ref[page_ids].reshape(block_k, head_dim)
        s = block_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
        k_pos = lax.broadcast_in_dim(blk * block_k + jnp.arange(block_k, dtype=jnp.int32), (rows, block_k), (1,))
        valid = row_ok & (k_pos <= q_pos_2d) & (k_pos < kv_len)
        if sliding_window is not None:
            valid = valid & (q_pos_2d - k_pos < sliding_window)
        return online_softmax_step(acc, m_prev, l_prev, s, valid, v, precision)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))
    acc, _, l = lax.fori_loop(0, num_iters, body, init)
    out = acc / jnp.where(l > 0, l, 1.0)
    o_ref[...] = out.reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _prefill_call(q4, k_pages, v_pages, meta, page_table, *, sm_scale, soft_cap, sliding_window,
                  block_q, pages_per_block, num_warps, num_stages, interpret):
    t_pad, num_kv_heads, group, head_dim = q4.shape
    _, num_pages, page_size, _ = k_pages.shape
    kernel = functools.partial(_prefill_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               precision=dot_precision(q4.dtype))
    kv_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda h, i: (h, 0, 0, 0))
    q_spec = pl.BlockSpec((block_q, None, group, head_dim), lambda h, i: (i, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(num_kv_heads, t_pad // block_q),
        in_specs=[
            pl.BlockSpec((2,), lambda h, i: (0,)),
            pl.BlockSpec((page_table.shape[0],), lambda h, i: (0,)),
            q_spec, kv_spec, kv_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill_attention_triton",
    )(meta, page_table, q4, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "block_q",
                                             "pages_per_compute_block", "num_warps", "num_stages", "interpret"))
def paged_prefill_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, q_start: jax.Array,
                                kv_len: jax.Array, page_table: jax.Array, *, sm_scale: float,
                                soft_cap: float | None = None, sliding_window: int | None = None,
                                block_q: int | None = None, pages_per_compute_block: int | None = None,
                                num_warps: int | None = None, num_stages: int = 2,
                                interpret: bool = False) -> jax.Array:
    """Triton paged prefill attention; same contract as `paged_prefill_attention_reference`.

    Args:
      q: [chunk, num_heads, head_dim]; row i is the token at position q_start + i.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache, with the chunk's
        own K/V already written.
      q_start: int scalar, position of the chunk's first token.
      kv_len: int scalar, q_start + number of real tokens in the chunk; rows past it are padding.
      page_table: [max_pages] int the sequence's page ids.
      sm_scale: softmax scale (static).
      soft_cap, sliding_window: optional static soft-cap and window, as for decode.
      block_q: query tokens per program (a power of 2; default: ~128 rows of block_q x group, 64 for f32).
      pages_per_compute_block: pages per key block (default: ~64 keys, 32 for f32; at least 16).
      num_warps, num_stages: Triton launch options (num_warps default: 8 for >= 128 rows, else 4).
      interpret: run in Pallas interpret mode (CPU testing).
    Returns:
      [chunk, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    check_prefill_args(q, k_pages, v_pages, q_start, kv_len, page_table, soft_cap, sliding_window)
    chunk, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    # Triton tensors must have power-of-2 sizes; interpret mode (CPU) has no such limit, so tiny test
    # models (head_dim 8) can still run the kernel's logic there.
    if not interpret and not (is_pow2(page_size) and is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"the Triton kernel needs a power-of-2 page_size and head_dim >= 16, "
                         f"got page_size={page_size}, head_dim={head_dim}")
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    wide = jnp.dtype(q.dtype).itemsize >= 4  # f32 tiles take twice the registers / shared memory
    if block_q is None:
        block_q = min(max(1, (64 if wide else 128) // group_pad), next_pow2(chunk))
    if not is_pow2(block_q):
        raise ValueError(f"block_q must be a power of 2, got {block_q}")
    block_q = max(block_q, MIN_DOT_ROWS // group_pad)  # at least 16 rows for tl.dot
    ppb = pick_pages_per_block(page_size, page_table.shape[0], pages_per_compute_block,
                               target_tokens=32 if wide else 64, min_tokens=MIN_DOT_ROWS)
    if not interpret and not is_pow2(ppb):
        raise ValueError(f"pages_per_compute_block must be a power of 2 for Triton, got {ppb}")
    if num_warps is None:
        num_warps = 8 if block_q * group_pad >= 128 else 4

    t_pad = round_up(chunk, block_q)
    q4 = q.reshape(chunk, num_kv_heads, group, head_dim)
    if t_pad != chunk or group_pad != group:
        q4 = jnp.pad(q4, ((0, t_pad - chunk), (0, 0), (0, group_pad - group), (0, 0)))
    meta = jnp.stack([jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)])
    out = _prefill_call(q4, k_pages, v_pages, meta, pad_page_table(page_table, ppb), sm_scale=float(sm_scale),
                        soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
                        block_q=block_q, pages_per_block=ppb, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)
    return out[:chunk, :, :group].reshape(chunk, num_heads, head_dim)
