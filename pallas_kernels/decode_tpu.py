"""Paged decode attention for TPUs (Pallas Mosaic backend).

1. `lengths` and the flattened page tables are scalar-prefetch operands: they sit in SMEM before the grid
   starts, so the kernel can address pages with them.
2. The grid is `(batch, kv_head)`, both parallel (megacore shards it). One step owns a slot's query group
   (GQA inside the kernel, padded to 8 rows) and one KV head; the K/V cache stays in HBM (`pl.ANY`).
3. The step walks the slot's pages one compute block (`pages_per_compute_block` pages) at a time: it DMAs
   block i+1 into the other half of a double-buffered VMEM scratch while computing on block i, and keeps
   the online softmax (running max, denominator, f32 accumulator) in VMEM scratch.
4. Only blocks overlapping [length - window, length) are copied; an idle slot (length 0) copies nothing and
   writes zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import (
    check_decode_args,
    dot_precision,
    pad_page_table,
    pick_pages_per_block,
    round_up,
)
from pallas_kernels._tpu_call import attend_paged_blocks, paged_flash_call

SUBLANES = 8  # q-group rows are padded to a whole sublane tile


def _decode_kernel(lengths_ref,  # [batch] int32 (SMEM, scalar prefetch)
                   page_tables_ref,  # [batch * max_pages_padded] int32 (SMEM, scalar prefetch)
                   q_ref,  # [group_pad, head_dim] (VMEM block) this slot's queries of one KV group
                   k_hbm_ref,  # [num_kv_heads, num_pages, page_size, head_dim] (HBM)
                   v_hbm_ref,  # [num_kv_heads, num_pages, page_size, head_dim] (HBM)
                   o_ref,  # [group_pad, head_dim] (VMEM block)
                   k_buf,  # [2, pages_per_block, page_size, head_dim] VMEM double buffer
                   v_buf,  # [2, pages_per_block, page_size, head_dim]
                   sems,  # DMA semaphores [2 (k, v), 2 (buffer slot)]
                   m_ref,  # [group_pad, 1] f32 running max
                   l_ref,  # [group_pad, 1] f32 running denominator
                   acc_ref,  # [group_pad, head_dim] f32 running numerator
                   *, sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                   pages_per_block: int, max_pages: int, precision):
    b, h = pl.program_id(0), pl.program_id(1)
    page_size = k_buf.shape[2]
    block_k = pages_per_block * page_size
    rows = q_ref.shape[0]
    length = lengths_ref[b]

    end_blk = jnp.minimum(lax.div(length + block_k - 1, block_k), max_pages // pages_per_block)
    if sliding_window is None:
        start_blk = 0
    else:  # the new token at length-1 sees keys at positions >= length - window
        start_blk = lax.div(jnp.maximum(length - sliding_window, 0), block_k)
    num_iters = jnp.maximum(end_blk - start_blk, 0)

    def mask(blk):
        pos = blk * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        valid = pos < length
        if sliding_window is not None:
            valid = valid & (pos >= length - sliding_window)
        return valid

    out = attend_paged_blocks(q_ref[...], lambda i: page_tables_ref[b * max_pages + i], k_hbm_ref, v_hbm_ref,
                              k_buf, v_buf, sems, m_ref, l_ref, acc_ref, kv_head=h, start_blk=start_blk,
                              num_iters=num_iters, mask=mask, sm_scale=sm_scale, soft_cap=soft_cap,
                              precision=precision)
    o_ref[...] = out.astype(o_ref.dtype)


def _decode_call(q4, k_pages, v_pages, lengths, page_tables_flat, *, max_pages, sm_scale, soft_cap,
                 sliding_window, pages_per_block, interpret):
    batch, num_kv_heads, rows, head_dim = q4.shape
    _, _, page_size, _ = k_pages.shape
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               max_pages=max_pages, precision=dot_precision(q4.dtype))
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, *_: (b, h, 0, 0))
    return paged_flash_call(kernel, (lengths, page_tables_flat), q4, k_pages, v_pages, grid=(batch, num_kv_heads),
                            q_spec=q_spec, rows=rows, pages_per_block=pages_per_block,
                            name="paged_decode_attention_mosaic", interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "pages_per_compute_block",
                                             "interpret"))
def paged_decode_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, lengths: jax.Array,
                               page_tables: jax.Array, *, sm_scale: float, soft_cap: float | None = None,
                               sliding_window: int | None = None, pages_per_compute_block: int | None = None,
                               interpret: bool | pltpu.InterpretParams = False) -> jax.Array:
    """Mosaic (TPU) paged decode attention; same contract as `paged_decode_attention_reference`.

    Args:
      q: [batch, num_heads, head_dim] queries; the token of slot b sits at position lengths[b] - 1.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache.
      lengths: [batch] int number of valid cached tokens per slot, the new one included; 0 = idle slot.
      page_tables: [batch, max_pages] int page ids per slot (padding entries point at the null page 0).
      sm_scale: softmax scale (static).
      soft_cap: optional static logit soft-cap (cap * tanh(s / cap)).
      sliding_window: optional static window; keys with q_pos - k_pos < window are attended.
      pages_per_compute_block: pages DMA'd per loop step (default: ~128 keys).
      interpret: True (or a `pltpu.InterpretParams`, e.g. with detect_races=True) runs under TPU
        interpret mode, simulating DMAs, semaphores and VMEM on CPU.
    Returns:
      [batch, num_heads, head_dim] in q's dtype; zeros for idle slots.
    """
    check_decode_args(q, k_pages, v_pages, lengths, page_tables, soft_cap, sliding_window)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    rows = round_up(group, SUBLANES)
    ppb = pick_pages_per_block(page_size, page_tables.shape[1], pages_per_compute_block, target_tokens=128)
    q4 = q.reshape(batch, num_kv_heads, group, head_dim)
    if rows != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    tables = pad_page_table(page_tables, ppb)
    out = _decode_call(q4, k_pages, v_pages, lengths.astype(jnp.int32), tables.reshape(-1),
                       max_pages=tables.shape[1], sm_scale=float(sm_scale),
                       soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
                       pages_per_block=ppb, interpret=interpret)
    return out[:, :, :group].reshape(batch, num_heads, head_dim)
