"""Ragged paged attention for GPUs, written for Pallas' Triton backend.

1. The wrapper cuts each sequence's query rows into work items of up to `block_q` consecutive tokens of
   that sequence (a decode is one item, a 100-token chunk ceil(100 / block_q) items) and lists them with
   jnp: the item's sequence and its first flat row. The list has a static length, ceil(T / block_q) plus
   one per sequence, enough for any batch of T tokens; entries past the real items have sequence -1 and
   cover the padding rows (from cu_q_lens[-1] on), block_q rows each, which they zero.
2. q is viewed as `[T, KVH, G_pad, D]` (the GQA group padded to a power of 2; a tile's rows past T are
   masked in its load, so a power-of-2 group's q is read where it lies, with no padded copy). The
   grid is `(item, kv_head)`: a program loads its item's block_q tokens x G_pad heads as one
   `[block_q * G_pad, D]` matrix, so each K/V tile it reads serves a whole group of several tokens.
3. The program walks its sequence's page-table row one key block (`pages_per_compute_block` pages) at a
   time, from the first block the sliding window reaches to the block holding its last row's position
   (causal), gathering the pages straight from the cache, with an online softmax in float32.
   With bidirectional spans (`span_ends`, Gemma 3's images) a row's causal edge moves to its span's end
   (capped at kv_len - 1): the program loads its rows' span ends and walks on to the furthest one; no
   span reaches past the last row of its sequence, so decode items walk exactly the blocks they did.
4. It stores only the rows of its own sequence (a masked store: the tile may run into the next
   sequence's rows, which another program owns). The output has exactly T rows, so the kernel's result is
   the layer's, with no pass after it (issue 52: a step's kernels per layer).
5. With `num_kv_splits` S > 1 the grid gains a third axis: each of an item's S programs folds a contiguous
   share of its key blocks and stores its unnormalized sum with its running max and softmax sum, and one
   more kernel (`_merge_call`, a program per row and KV head) rescales the S shares to a common max and
   zeroes the padding rows (FlashDecoding's split-K). A split that gets no key block stores no sum, and
   the merge loads only the sums of splits that saw keys, so short contexts move no partial sums. A decode
   batch of few sequences otherwise runs one program per sequence and KV head, far fewer than the GPU's
   multiprocessors. S is an upper bound: a sequence uses only as many splits as give each at least
   `min_keys_per_split` keys (its other splits store an empty state), so short contexts are not split
   however large S is. Decode-shaped batches default to S = `default_kv_splits` (up to 16, fewer for
   larger buckets so the partial outputs stay small, and none past what the page tables' longest context
   can use); measured on an H200 (docs/performance.md), one
   sequence of 32768 keys took 1.128 ms unsplit and 0.136 / 0.108 ms with 16 / 32 splits.
Quantized pages (int8 / fp8, `kv_quant.py`) are gathered as codes with their pages' scales (one more
operand per KV head each for K and V: the lane-dense scales viewed as `[pages, page_size]` rows),
converted to q's dtype in registers, and the scales folded into the scores and the value weights.

The default query tile (`default_tiles`) follows the batch's static shape. A batch with no more tokens
than sequences is decode-shaped: each item is one token filling G_pad rows, so the tile is tl.dot's minimum
of 16 rows and no arithmetic is spent on empty ones. A batch with more tokens than sequences holds prefill
chunks, and 2-byte queries get 64-row tiles, so each K/V block is read once per 64 rows. Measured on an
H200 (docs/performance.md) against the fixed 32 rows that were the default before, 128-key blocks in both:
64 bf16 decodes over 2048 keys 0.30 ms against 0.34, a 2048-token prefill 0.32 ms against 0.57, and 60
decodes with a 512-token chunk in one call 0.38 ms against 0.45. Float32 tiles stay at 32 rows. Key blocks
are 64 keys for every dtype: on the H200's second run they beat 128-key blocks for bf16 decode (0.281
against 0.298 ms) and for the 64-row prefill tile (0.231 against 0.320 ms).
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
    check_block_q,
    check_ragged_args,
    dot_precision,
    is_pow2,
    next_pow2,
    online_softmax_step,
    pad_page_table,
    pick_pages_per_block,
)

MIN_DOT_ROWS = 16  # Triton's tl.dot needs M, N, K >= 16
PREFILL_ROWS = {2: 64, 4: 32}  # query rows (tokens x group) per program by q's bytes; see the module docstring
KEYS_PER_BLOCK = 64  # keys per compute block by default (module docstring)
MAX_DEFAULT_SPLITS = 16  # split-K default for decode-shaped batches of up to SPLIT_TOKEN_BUDGET // 16 tokens
SPLIT_TOKEN_BUDGET = 256  # tokens x default splits: bounds the float32 partial outputs the merge reads
MIN_KEYS_PER_SPLIT = 1024  # a sequence splits its keys only into shares at least this long


def decode_shaped(tokens: int, num_seqs: int) -> bool:
    """A static batch shape with no more tokens than sequences: each item is one decode token (as far as the
    shape can tell), the case both default tiles and default splits are chosen for."""
    return tokens <= num_seqs


def default_tiles(tokens: int, num_seqs: int, group_pad: int, itemsize: int) -> tuple[int, int]:
    """(query tokens per program, keys per block) when the caller names neither: the smallest query tile
    for decode-shaped batches, a wide one for batches holding prefill chunks (narrower for float32, which
    takes twice the registers); KEYS_PER_BLOCK keys per block."""
    rows = MIN_DOT_ROWS if decode_shaped(tokens, num_seqs) else PREFILL_ROWS.get(itemsize, 32)
    return max(1, rows // group_pad), KEYS_PER_BLOCK


def default_kv_splits(tokens: int, num_seqs: int, interpret: bool, max_keys: int | None = None,
                      min_keys_per_split: int = MIN_KEYS_PER_SPLIT) -> int:
    """Split-K's upper bound when the caller names none: decode-shaped batches (no more tokens than
    sequences) up to MAX_DEFAULT_SPLITS, fewer as the bucket grows (tokens x splits <= SPLIT_TOKEN_BUDGET),
    and no more than the longest context the page tables hold (`max_keys`) gives at `min_keys_per_split`
    keys a split: an engine whose contexts are too short to split has no split programs, partial sums or
    merge at all. Batches holding prefill chunks have items enough and keep 1. Interpret mode (CPU tests)
    keeps 1: each split is one more interpreted program, and the tests name their splits."""
    if interpret or not decode_shaped(tokens, num_seqs):
        return 1
    splits = min(MAX_DEFAULT_SPLITS, SPLIT_TOKEN_BUDGET // max(tokens, 1))
    if max_keys is not None:
        splits = min(splits, max_keys // min_keys_per_split)
    return max(1, splits)


def _ragged_kernel(item_seq_ref,  # [num_items] int32: the item's sequence, -1 past the real items
                   item_row_ref,  # [num_items] int32: the item's first flat query row (padding rows past them)
                   kv_lens_ref,  # [num_seqs] int32
                   cu_q_lens_ref,  # [num_seqs + 1] int32
                   page_tables_ref,  # [num_seqs * max_pages_padded] int32, flattened rows
                   q_ref,  # [T, group_pad, head_dim] this KV head's queries, every row
                   k_ref,  # [num_pages, page_size, head_dim] this KV head's pages
                   v_ref,  # [num_pages, page_size, head_dim]
                   *refs,  # with spans: span_ref [(T + block_q) * group_pad] int32, each row's span end, per query head;
                   #         quantized pages: k_scales_ref, v_scales_ref [>= num_pages, page_size] float32; then
                   #         o_ref [T, group_pad, head_dim] (only this item's rows are written), or with
                   #         splits this split's acc_ref (the same, float32), m_ref and l_ref [T, group_pad]
                   sm_scale: float, soft_cap: float | None, sliding_window: int | None, block_q: int,
                   pages_per_block: int, max_pages: int, precision, quantized: bool, spans: bool,
                   num_splits: int, min_blocks_per_split: int):
    span_ref, *refs = refs if spans else (None, *refs)
    k_scales_ref, v_scales_ref, *out_refs = refs if quantized else (None, None, *refs)
    _, group, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    rows = block_q * group
    item = pl.program_id(0)
    # Read here: interpret mode cannot lower program_id inside pl.when's branch.
    split = pl.program_id(2) if num_splits > 1 else 0
    seq = item_seq_ref[item]

    if num_splits == 1:
        @pl.when(seq < 0)
        def _():  # an item past the real ones: zero its share of the padding rows (the merge does, with splits)
            (o_ref,) = out_refs
            tokens = item_row_ref[item] + jnp.arange(block_q, dtype=jnp.int32)
            mask = lax.broadcast_in_dim(tokens < o_ref.shape[0], (block_q, group, head_dim), (0,))
            plgpu.store(o_ref.at[pl.ds(item_row_ref[item], block_q)],
                        jnp.zeros((block_q, group, head_dim), o_ref.dtype), mask=mask)

    @pl.when(seq >= 0)
    def _():
        first_row = item_row_ref[item]
        end_row = jnp.minimum(first_row + block_q, cu_q_lens_ref[seq + 1])
        # Sequence s's last row sits at position kv_len - 1, so row j sits at j + offset.
        offset = kv_lens_ref[seq] - cu_q_lens_ref[seq + 1]
        last_pos = end_row - 1 + offset
        # Row r of the tile is token r // group, head r % group (group is a power of 2: a shift).
        row_tokens = lambda: first_row + lax.div(jnp.arange(rows, dtype=jnp.int32), group)
        if spans:  # each row's last key: its span's end where that lies beyond it; the walk goes to the furthest
            span_end = jnp.minimum(span_ref[pl.ds(first_row * group, rows)], kv_lens_ref[seq] - 1)
            last_key = jnp.maximum(row_tokens() + offset, span_end)
            last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(row_tokens() < end_row, last_key, 0)))
        end_blk = jnp.minimum(lax.div(last_pos + block_k, block_k), max_pages // pages_per_block)
        if sliding_window is None:
            start_blk = 0
        else:
            start_blk = lax.div(jnp.maximum(first_row + offset - sliding_window + 1, 0), block_k)
        if num_splits > 1:  # this program's share of the key blocks: a contiguous run, maybe empty
            blocks = jnp.maximum(end_blk - start_blk, 0)
            # Only as many splits as give each at least min_blocks_per_split blocks; the rest get none.
            used = jnp.clip(lax.div(blocks + min_blocks_per_split - 1, min_blocks_per_split), 1, num_splits)
            per_split = lax.div(blocks + used - 1, used)
            start_blk = start_blk + split * per_split
            end_blk = jnp.minimum(start_blk + per_split, end_blk)

        in_rows = lax.broadcast_in_dim(first_row + jnp.arange(block_q, dtype=jnp.int32) < q_ref.shape[0],
                                       (block_q, group, head_dim), (0,))
        q = plgpu.load(q_ref.at[pl.ds(first_row, block_q)], mask=in_rows, other=0.0).reshape(rows, head_dim)
        token = row_tokens()
        q_pos = lax.broadcast_in_dim(token + offset, (rows, block_k), (0,))
        last_keys = lax.broadcast_in_dim(last_key, (rows, block_k), (0,)) if spans else q_pos

        def body(i, carry):
            blk = start_blk + i
            page_ids = page_tables_ref[pl.ds(seq * max_pages + blk * pages_per_block, pages_per_block)]
            k = k_ref[page_ids].reshape(block_k, head_dim)
            v = v_ref[page_ids].reshape(block_k, head_dim)
            k_scale = v_scale = None
            if quantized:  # codes -> q's dtype is exact; the scales multiply scores and value weights
                k, v = k.astype(q.dtype), v.astype(q.dtype)
                k_scale = k_scales_ref[page_ids].reshape(1, block_k)
                v_scale = v_scales_ref[page_ids].reshape(1, block_k)
            s = block_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision, k_scale=k_scale)
            k_pos = lax.broadcast_in_dim(blk * block_k + jnp.arange(block_k, dtype=jnp.int32), (rows, block_k),
                                         (1,))
            # Causal or within the span; k_pos < kv_len follows for the rows that get stored (their last key is
            # below kv_len). Rows past end_row may see garbage keys, but the masked store drops them.
            valid = k_pos <= last_keys
            if sliding_window is not None:
                valid = valid & (q_pos - k_pos < sliding_window)
            return online_softmax_step(*carry, s, valid, v, precision, v_scale)

        init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows, 1), MASK_VALUE, jnp.float32),
                jnp.zeros((rows, 1), jnp.float32))
        acc, m, l = lax.fori_loop(0, jnp.maximum(end_blk - start_blk, 0), body, init)
        tokens = first_row + jnp.arange(block_q, dtype=jnp.int32)
        store_mask = lax.broadcast_in_dim(tokens < end_row, (block_q, group, head_dim), (0,))
        here = pl.ds(first_row, block_q)
        if num_splits == 1:
            (o_ref,) = out_refs
            out = (acc / jnp.where(l > 0, l, 1.0)).reshape(block_q, group, head_dim).astype(o_ref.dtype)
            plgpu.store(o_ref.at[here], out, mask=store_mask)
        else:  # unnormalized, with the softmax state the merge weighs the splits by; no sum from an empty split
            acc_ref, m_ref, l_ref = out_refs
            plgpu.store(acc_ref.at[here], acc.reshape(block_q, group, head_dim),
                        mask=store_mask & (end_blk > start_blk))
            row_mask = lax.broadcast_in_dim(tokens < end_row, (block_q, group), (0,))
            plgpu.store(m_ref.at[here], m.reshape(block_q, group), mask=row_mask)
            plgpu.store(l_ref.at[here], l.reshape(block_q, group), mask=row_mask)


def _ragged_call(items, kv_lens, cu_q_lens, tables_flat, q4, kv, span_rows, *, tokens, max_pages, sm_scale, soft_cap,
                 sliding_window, block_q, pages_per_block, num_warps, num_stages, num_splits, min_blocks_per_split,
                 interpret):
    item_seq, item_row = items
    q_rows, num_kv_heads, group, head_dim = q4.shape
    k_pages, v_pages, k_scales, v_scales = kv
    _, num_pages, page_size, _ = k_pages.shape
    kv = [k_pages, v_pages]
    quantized = k_scales is not None
    if quantized:  # lane-dense scales as whole pages' rows (a free reshape, `kv_quant.page_scales`)
        kv += [scales.reshape(num_kv_heads, -1, page_size) for scales in (k_scales, v_scales)]
    kernel = functools.partial(_ragged_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, block_q=block_q, pages_per_block=pages_per_block,
                               max_pages=max_pages, precision=dot_precision(q4.dtype), quantized=quantized,
                               spans=span_rows is not None, num_splits=num_splits,
                               min_blocks_per_split=min_blocks_per_split)
    # Grid (item, KV head), and a split axis when there are splits: the index maps ignore it, except for the
    # split outputs' own axis. Unsplit, the grid stays two-dimensional: the kernel measured on the H200.
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, h, *_: (0,) * x.ndim)
    kv_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda i, h, *_: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, kv[-1].shape[1], page_size), lambda i, h, *_: (h, 0, 0))
    q_spec = pl.BlockSpec((q_rows, None, group, head_dim), lambda i, h, *_: (0, h, 0, 0))
    spans = [] if span_rows is None else [span_rows]
    out_rows = (tokens, num_kv_heads, group, head_dim)  # q's rows without the spare tile
    if num_splits == 1:
        out_specs = pl.BlockSpec((tokens, None, group, head_dim), lambda i, h: (0, h, 0, 0))
        out_shape = jax.ShapeDtypeStruct(out_rows, q4.dtype)
    else:
        out_specs = (pl.BlockSpec((None, tokens, None, group, head_dim), lambda i, h, s: (s, 0, h, 0, 0)),
                     *[pl.BlockSpec((None, tokens, None, group), lambda i, h, s: (s, 0, h, 0))] * 2)
        out_shape = (jax.ShapeDtypeStruct((num_splits, *out_rows), jnp.float32),
                     *[jax.ShapeDtypeStruct((num_splits, *out_rows[:3]), jnp.float32)] * 2)
    return pl.pallas_call(
        kernel,
        grid=(item_seq.shape[0], num_kv_heads) + ((num_splits,) if num_splits > 1 else ()),
        in_specs=[whole(item_seq), whole(item_row), whole(kv_lens), whole(cu_q_lens), whole(tables_flat),
                  q_spec, kv_spec, kv_spec] + [whole(x) for x in spans] + [scale_spec] * (len(kv) - 2),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(item_seq, item_row, kv_lens, cu_q_lens, tables_flat, q4, *kv[:2], *spans, *kv[2:])


def _merge_kernel(real_rows_ref,  # [1] int32: cu_q_lens[-1], the first padding row
                  acc_ref,  # [S, group_pad, head_dim] float32: this row's and KV head's unnormalized split sums
                  m_ref,  # [S, group_pad] float32: each split's running max
                  l_ref,  # [S, group_pad] float32: each split's softmax sum, 0 for a split that saw no key
                  o_ref):  # [group_pad, head_dim]
    # Each split's share is rescaled to the common max. A split that saw no key stored no sum (and a padding
    # row's state is whatever the buffers held): only the sums of splits with l > 0 are loaded or weighed.
    seen = l_ref[...] > 0
    m = jnp.where(seen, m_ref[...], MASK_VALUE)
    w = jnp.where(seen, jnp.exp(m - jnp.max(m, axis=0)[None]), 0.0)  # [S, group]
    total = jnp.sum(jnp.where(seen, w * l_ref[...], 0.0), axis=0)
    acc = plgpu.load(acc_ref, mask=lax.broadcast_in_dim(seen, acc_ref.shape, (0, 1)), other=0.0)
    out = jnp.sum(w[:, :, None] * acc, axis=0) / jnp.where(total > 0, total, 1.0)[:, None]
    real = pl.program_id(0) < real_rows_ref[0]
    o_ref[...] = jnp.where(real, out, 0.0).astype(o_ref.dtype)


def _merge_call(acc: jax.Array, m: jax.Array, l: jax.Array, cu_q_lens: jax.Array, dtype, interpret: bool) -> jax.Array:
    """[T, KVH, group_pad, D] in `dtype` from the splits' partial softmax states (acc [S, T, KVH, group_pad, D],
    m and l [S, T, KVH, group_pad]): one program per row and KV head; padding rows come out as zeros."""
    splits, tokens, num_kv_heads, group, head_dim = acc.shape
    state = pl.BlockSpec((splits, None, None, group), lambda t, h: (0, t, h, 0))
    return pl.pallas_call(
        _merge_kernel,
        grid=(tokens, num_kv_heads),
        in_specs=[pl.BlockSpec((1,), lambda t, h: (0,)),
                  pl.BlockSpec((splits, None, None, group, head_dim), lambda t, h: (0, t, h, 0, 0)), state, state],
        out_specs=pl.BlockSpec((None, None, group, head_dim), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(acc.shape[1:], dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_merge",
    )(cu_q_lens[-1:], acc, m, l)


def work_items(cu_q_lens: jax.Array, block_q: int, num_items: int) -> tuple[jax.Array, jax.Array]:
    """(sequence, first row) of each block_q-token piece of each sequence's rows, [num_items] each;
    past the real pieces, sequence -1 and the padding rows block_q by block_q (from cu_q_lens[-1] on; there
    are items enough for all of them). Sequences without rows get no item."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pieces = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(pieces)
    i = jnp.arange(num_items, dtype=jnp.int32)
    # Compare-and-count, not searchsorted's default binary search: that compiles to a `while` loop, which
    # XLA:GPU's command buffers (CUDA graphs) do not take, so it split the step's graph and its ~26 kernels
    # were launched from the host one by one (issue 52). The arrays are small: items x sequences compares.
    seq = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"),
                      q_lens.shape[0] - 1).astype(jnp.int32)
    row = cu_q_lens[seq] + (i - (ends[seq] - pieces[seq])) * block_q
    real = i < ends[-1]
    padding_row = cu_q_lens[-1] + (i - ends[-1]) * block_q
    return jnp.where(real, seq, -1), jnp.where(real, row, padding_row).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "block_q",
                                             "pages_per_compute_block", "num_warps", "num_stages", "num_kv_splits",
                                             "min_keys_per_split", "interpret"))
def ragged_paged_attention_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                               page_tables: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                               soft_cap: float | None = None, sliding_window: int | None = None,
                               block_q: int | None = None, pages_per_compute_block: int | None = None,
                               num_warps: int | None = None, num_stages: int = 2, num_kv_splits: int | None = None,
                               min_keys_per_split: int = MIN_KEYS_PER_SPLIT, interpret: bool = False,
                               k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                               span_ends: jax.Array | None = None) -> jax.Array:
    """Triton ragged paged attention; same contract as `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, sm_scale, soft_cap, sliding_window, k_scales,
        v_scales, span_ends: as in `ragged_paged_attention_reference` (sm_scale, soft_cap and sliding_window are static
        here; quantized pages are gathered as codes, their scales beside them).
      block_q: query tokens per program (a power of 2; default: `default_tiles`, at least 16 rows).
      pages_per_compute_block: pages per key block (default: `default_tiles`' keys; at least 16 keys).
      num_warps, num_stages: Triton launch options (num_warps default: 8 for >= 128 rows, else 4).
      num_kv_splits: at most this many programs per item and KV head, each folding a contiguous share of the
        key blocks, merged by one more kernel (`_merge_call`): more programs in flight when a batch has few
        items and long contexts (FlashDecoding's split-K). Default: `default_kv_splits`.
      min_keys_per_split: a sequence uses only as many of the splits as give each at least this many keys.
      interpret: run in Pallas interpret mode (CPU testing).
    Returns:
      [tokens, num_heads, head_dim] in q's dtype; zeros for padding rows.
    """
    check_ragged_args(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, soft_cap, sliding_window,
                      k_scales, v_scales, span_ends)
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_seqs = page_tables.shape[0]
    # Triton tensors must have power-of-2 sizes; interpret mode (CPU) has no such limit, so tiny test
    # models (head_dim 8) can still run the kernel's logic there.
    if not interpret and not (is_pow2(page_size) and is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"the Triton kernel needs a power-of-2 page_size and head_dim >= 16, "
                         f"got page_size={page_size}, head_dim={head_dim}")
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    default_block_q, key_tokens = default_tiles(tokens, num_seqs, group_pad, jnp.dtype(q.dtype).itemsize)
    block_q = default_block_q if block_q is None else block_q
    check_block_q(block_q)
    block_q = max(block_q, MIN_DOT_ROWS // group_pad)  # at least 16 rows for tl.dot
    ppb = pick_pages_per_block(page_size, page_tables.shape[1], pages_per_compute_block,
                               target_tokens=key_tokens, min_tokens=MIN_DOT_ROWS)
    if not interpret and not is_pow2(ppb):
        raise ValueError(f"pages_per_compute_block must be a power of 2 for Triton, got {ppb}")
    if num_warps is None:
        num_warps = 8 if block_q * group_pad >= 128 else 4
    if num_kv_splits is None:
        num_kv_splits = default_kv_splits(tokens, num_seqs, interpret, page_tables.shape[1] * page_size,
                                          min_keys_per_split)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be at least 1, got {num_kv_splits}")

    # Rows past the last are masked in the kernel's load, so q is read as it lies (no copy of it; issue 52),
    # but a group that is not a power of 2, padded to one (Triton tensors).
    q4 = q.reshape(tokens, num_kv_heads, group, head_dim)
    if group_pad != group:
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    cu_q_lens, kv_lens = cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32)
    num_items = max(1, -(-tokens // block_q) + min(num_seqs, tokens))
    tables = pad_page_table(page_tables, ppb)
    split_blocks = max(1, -(-min_keys_per_split // (ppb * page_size)))  # blocks per split, at least
    span_rows = None
    if span_ends is not None:  # one span end per row of q4's tiles (token x padded group), flat, -1 past the rows
        span_rows = jnp.pad(span_ends.astype(jnp.int32), (0, block_q), constant_values=-1)
        span_rows = jnp.broadcast_to(span_rows[:, None], (tokens + block_q, group_pad)).reshape(-1)
    out = _ragged_call(work_items(cu_q_lens, block_q, num_items), kv_lens, cu_q_lens, tables.reshape(-1), q4,
                       (k_pages, v_pages, k_scales, v_scales), span_rows, tokens=tokens, max_pages=tables.shape[1],
                       sm_scale=float(sm_scale),
                       soft_cap=None if soft_cap is None else float(soft_cap), sliding_window=sliding_window,
                       block_q=block_q, pages_per_block=ppb, num_warps=num_warps, num_stages=num_stages,
                       num_splits=num_kv_splits, min_blocks_per_split=split_blocks, interpret=interpret)
    if num_kv_splits > 1:
        out = _merge_call(*out, cu_q_lens, q.dtype, interpret)
    return out[:, :, :group].reshape(tokens, num_heads, head_dim)  # a free reshape when group is a power of 2
