"""Ragged paged attention for TPUs (Pallas Mosaic backend): aligned query blocks over the flat tokens.

1. The wrapper lays the tokens out head-major, `[T, H, D] -> [KVH, G, T_pad, D]`, so one block
   `[G, block_q, D]` collapses to a `[G * block_q, D]` matrix without a sublane relayout (block_q is a
   power of 2 and a multiple of 16). Blocks are aligned to the flat array, not to sequences: one block can
   hold the single rows of many decodes, or a piece of a prefill chunk and its neighbours.
2. kv_lens, cu_q_lens, the flattened page tables and, per query block, the range of sequences whose rows
   overlap it (two searchsorteds over cu_q_lens) are scalar-prefetch operands in SMEM. The grid is
   `(kv_head, query_block)`, both parallel; the K/V cache stays in HBM (`pl.ANY`).
3. A grid step sets up one online-softmax state for all its rows, then, sequence by sequence, streams
   that sequence's key blocks (from the sliding window's start to the causal edge of its last row in the
   block) through the double-buffered DMA of `_tpu_call`, masking every row that is not the sequence's.
4. It normalises once at the end; padding rows belong to no sequence, see no key and come out as zeros.
5. With bidirectional spans (`span_ends`, Gemma 3's images) the wrapper turns each row's last visible key
   (its position, or its span's end beyond it, capped at kv_len - 1) into a flat row index, its *reach*
   (position p of sequence s is flat row p - offset_s). A row's reach never leaves its sequence's rows, so
   a running maximum over the flat rows is, at a sequence's row, the furthest key of its rows so far: one
   scalar-prefetched read gives a sequence's key range in a block, and the per-row reach (a VMEM block
   beside the queries) masks each row. A decode row's reach is itself: decodes walk the blocks they did.

The default block is ~128 rows (block_q = 128 // G_pad tokens, at least 16): on a decode-only block
most rows of each sequence's pass are other sequences' (masked), which costs MXU time the K/V stream
hides at that size, while a prefill chunk still gets a tile that reads each K/V block once per block_q
tokens. Sequences in a block run one after another; the next one's first DMA is not yet overlapped with
the previous one's last block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import (
    check_block_q,
    check_ragged_args,
    dot_precision,
    next_pow2,
    pad_page_table,
    pick_pages_per_block,
    round_up,
)
from pallas_kernels._tpu_call import (
    PagedRefs,
    attend_paged_blocks,
    init_softmax_state,
    normalised_output,
    paged_flash_call,
    split_kernel_refs,
)
from pallas_kernels.reference import last_visible_keys, token_layout

MIN_BLOCK_Q = 16  # a bf16 sublane tile, so [G, block_q, D] -> [G * block_q, D] is layout-free
DEFAULT_ROWS = 128  # query rows (group x tokens) per grid step; see the module docstring


def _ragged_kernel(kv_lens_ref,  # [num_seqs] int32 (SMEM, scalar prefetch)
                   cu_q_lens_ref,  # [num_seqs + 1] int32 (SMEM)
                   page_tables_ref,  # [num_seqs * max_pages_padded] int32 (SMEM)
                   block_seqs_ref,  # [2 * num_q_blocks] int32 (SMEM): first, end sequence per query block
                   *refs,  # with spans: furthest_ref [T_pad] int32 (SMEM), the running maximum of the reach;
                   #         q_ref [group, block_q, head_dim] (VMEM block) queries of one KV group; with spans
                   #         reach_ref [group, block_q, 1] int32 (VMEM block), each row's reach;
                   #         K/V (and scales) in HBM, o_ref [group, block_q, head_dim], VMEM scratch: see
                   #         `split_kernel_refs`; m, l [group * block_q, 1], acc [group * block_q, head_dim]
                   sm_scale: float, soft_cap: float | None, sliding_window: int | None,
                   pages_per_block: int, max_pages: int, precision, quantized: bool, spans: bool):
    if spans:
        furthest_ref, q_ref, reach_ref, *refs = refs
    else:
        q_ref, *refs = refs
    hbm, o_ref, bufs, sems, m_ref, l_ref, acc_ref = split_kernel_refs(refs, quantized)
    h, qb = pl.program_id(0), pl.program_id(1)
    group, block_q, head_dim = q_ref.shape
    page_size = bufs.k.shape[2]
    block_k = pages_per_block * page_size
    rows = group * block_q
    block_start = qb * block_q

    # Row r is head r // block_q, token r % block_q; block_q is a power of 2, so the token of a row is a
    # bit-mask, not a vector remainder.
    token = block_start + (lax.broadcasted_iota(jnp.int32, (rows, block_k), 0) & (block_q - 1))
    q = q_ref[...].reshape(rows, head_dim)
    reach = reach_ref[...].reshape(rows, 1) if spans else None  # flat row of each row's last visible key
    init_softmax_state(m_ref, l_ref, acc_ref)

    def one_sequence(s, carry):
        lo = jnp.maximum(cu_q_lens_ref[s], block_start)  # this sequence's rows in the block: [lo, hi)
        hi = jnp.minimum(cu_q_lens_ref[s + 1], block_start + block_q)
        offset = kv_lens_ref[s] - cu_q_lens_ref[s + 1]  # row j sits at position j + offset
        # The flat row whose position is the furthest key these rows see: the last row's, or a span's end.
        last_row = furthest_ref[jnp.maximum(hi - 1, 0)] if spans else hi - 1
        end_blk = jnp.minimum(lax.div(last_row + offset + block_k, block_k), max_pages // pages_per_block)
        if sliding_window is None:
            start_blk = 0
        else:
            start_blk = lax.div(jnp.maximum(lo + offset - sliding_window + 1, 0), block_k)
        num_iters = jnp.where(hi > lo, jnp.maximum(end_blk - start_blk, 0), 0)

        def mask(blk):
            k_pos = blk * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
            q_pos = token + offset
            last_key = q_pos if reach is None else reach + offset  # causal, or to the span's end
            valid = (token >= lo) & (token < hi) & (k_pos <= last_key)  # k_pos < kv_len follows
            if sliding_window is not None:
                valid = valid & (q_pos - k_pos < sliding_window)
            return valid

        attend_paged_blocks(q, lambda i: page_tables_ref[s * max_pages + i], hbm, bufs, sems, m_ref, l_ref,
                            acc_ref, kv_head=h, start_blk=start_blk, num_iters=num_iters, mask=mask,
                            sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
        return carry

    lax.fori_loop(block_seqs_ref[2 * qb], block_seqs_ref[2 * qb + 1], one_sequence, 0)
    o_ref[...] = normalised_output(l_ref, acc_ref).reshape(group, block_q, head_dim).astype(o_ref.dtype)


def _ragged_call(scalars, q4, kv: PagedRefs, reach, *, max_pages, sm_scale, soft_cap, sliding_window, block_q,
                 pages_per_block, interpret):
    num_kv_heads, group, t_pad, head_dim = q4.shape
    kernel = functools.partial(_ragged_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_block=pages_per_block,
                               max_pages=max_pages, precision=dot_precision(q4.dtype),
                               quantized=kv.k_scales is not None, spans=reach is not None)
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i, *_: (h, 0, i, 0))
    row_inputs = ()
    if reach is not None:  # scalar: its running maximum; per row: the reach laid out as the query rows
        scalars += (lax.cummax(reach),)
        rows = jnp.broadcast_to(reach[None, :, None], (group, t_pad, 1))
        row_inputs = ((rows, pl.BlockSpec((group, block_q, 1), lambda h, i, *_: (0, i, 0))),)
    return paged_flash_call(kernel, scalars, q4, kv, grid=(num_kv_heads, t_pad // block_q),
                            q_spec=q_spec, rows=group * block_q, pages_per_block=pages_per_block,
                            name="ragged_paged_attention_mosaic", interpret=interpret, row_inputs=row_inputs)


def span_reach(span_ends: jax.Array, cu_q_lens: jax.Array, kv_lens: jax.Array, t_pad: int) -> jax.Array:
    """[t_pad] int32: per flat row, the flat row index whose position is its last visible key (its own
    index without a span); rows past the tokens are their own reach."""
    tokens = span_ends.shape[0]
    seq, pos, _ = token_layout(cu_q_lens, kv_lens, tokens)
    rows = jnp.arange(t_pad, dtype=jnp.int32)
    reach = last_visible_keys(span_ends, pos, kv_lens[seq]) - pos + rows[:tokens]
    return rows.at[:tokens].set(reach)


def block_sequences(cu_q_lens: jax.Array, block_q: int, num_blocks: int) -> jax.Array:
    """[2 * num_blocks] int32: for query block b, the first and one-past-last sequence whose rows overlap
    rows [b * block_q, (b + 1) * block_q); an empty range for blocks of padding rows."""
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    first = jnp.searchsorted(cu_q_lens[1:], starts, side="right")  # sequences that end at or before it
    end = jnp.searchsorted(cu_q_lens[:-1], starts + block_q, side="left")  # sequences that start inside it
    return jnp.stack([first, jnp.maximum(end, first)], axis=1).reshape(-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "block_q",
                                             "pages_per_compute_block", "interpret"))
def ragged_paged_attention_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                               page_tables: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                               soft_cap: float | None = None, sliding_window: int | None = None,
                               block_q: int | None = None, pages_per_compute_block: int | None = None,
                               interpret: bool | pltpu.InterpretParams = False, k_scales: jax.Array | None = None,
                               v_scales: jax.Array | None = None, span_ends: jax.Array | None = None) -> jax.Array:
    """Mosaic (TPU) ragged paged attention; same contract as `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, sm_scale, soft_cap, sliding_window, k_scales,
        v_scales, span_ends: as in `ragged_paged_attention_reference` (sm_scale, soft_cap and sliding_window
        are static here; quantized pages are DMA'd as codes with their scales beside them).
      block_q: query tokens per grid step (power of 2, >= 16; default: ~128 rows of group x block_q).
      pages_per_compute_block: pages DMA'd per loop step (default: ~128 keys).
      interpret: True (or a `pltpu.InterpretParams`, e.g. with detect_races=True) runs under TPU
        interpret mode, simulating DMAs, semaphores and VMEM on CPU.
    Returns:
      [tokens, num_heads, head_dim] in q's dtype; zeros for padding rows.
    """
    check_ragged_args(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, soft_cap, sliding_window,
                      k_scales, v_scales, span_ends)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_heads // num_kv_heads
    if block_q is None:
        block_q = min(max(MIN_BLOCK_Q, DEFAULT_ROWS // next_pow2(group)), next_pow2(max(tokens, MIN_BLOCK_Q)))
    check_block_q(block_q, MIN_BLOCK_Q)
    ppb = pick_pages_per_block(page_size, page_tables.shape[1], pages_per_compute_block, target_tokens=128)

    t_pad = round_up(max(tokens, 1), block_q)
    q4 = q.reshape(tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [KVH, G, T, D]
    if t_pad != tokens:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, t_pad - tokens), (0, 0)))
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tables = pad_page_table(page_tables, ppb)
    kv_lens = kv_lens.astype(jnp.int32)
    scalars = (kv_lens, cu_q_lens, tables.reshape(-1), block_sequences(cu_q_lens, block_q, t_pad // block_q))
    reach = None if span_ends is None else span_reach(span_ends, cu_q_lens, kv_lens, t_pad)
    out = _ragged_call(scalars, q4, PagedRefs(k_pages, v_pages, k_scales, v_scales), reach,
                       max_pages=tables.shape[1], sm_scale=float(sm_scale),
                       soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
                       block_q=block_q, pages_per_block=ppb, interpret=interpret)
    return out[:, :, :tokens].transpose(2, 0, 1, 3).reshape(tokens, num_heads, head_dim)
