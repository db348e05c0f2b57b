"""Pure-`jnp` ragged paged attention: the definition every implementation is tested against.

The KV cache of one layer is two arrays of pages, `[num_kv_heads, num_pages, page_size, head_dim]`.
A sequence owns a row of a page table; token `t` of the sequence lives in page
`page_table[t // page_size]` at offset `t % page_size`. Page 0 is the null page that padding points at.

One engine step is a *ragged batch*: the new tokens of every scheduled sequence, flat and contiguous per
sequence. Sequence `s` owns query rows `cu_q_lens[s] .. cu_q_lens[s + 1] - 1`; they are its last
`q_len = cu_q_lens[s + 1] - cu_q_lens[s]` tokens, whose K/V is already written, so row `j` sits at position
`kv_lens[s] - q_len + (j - cu_q_lens[s])`. A decoding sequence has one row, a prefill chunk many; padding
sequences have none, and rows from `cu_q_lens[-1]` on are padding tokens.

Attention is causal, optionally within a sliding window, and optionally widened per row by a *span*
(`span_ends`): the row also sees the later keys up to its span's end. That is bidirectional attention
inside a run of tokens, as Gemma 3 has among one image's tokens (transformers' `blockwise_overlay` on
`token_type_ids`): every token of an image carries the image's last position, every other row -1. A
row's last visible key is therefore `max(position, span_end)`, capped at `kv_len - 1`; no kernel is
special to images.

This version is written to be obviously right, not fast: every query row gathers its sequence's whole
page-table row into a dense `[kv_heads, max_pages * page_size, head_dim]` view and runs an ordinary
masked softmax in float32. `blocked.py` is the efficient jnp implementation the CPU serves with.
Quantized pages (int8 / fp8 with per-token scales, `kv_quant.py`) are dequantized right in that gathered
view: here the definition of correct, where the other implementations fold the scales into the math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import check_kv_scales, dequantize_kv, page_scales

# Finite, so a fully masked row (a padding token) gives zeros instead of NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def validate_paged_inputs(q_heads: int, head_dim: int, k_pages: jax.Array, v_pages: jax.Array,
                          page_table: jax.Array) -> None:
    """Shape checks shared by the reference and every kernel; raises ValueError naming the input."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_kv_heads, num_pages, page_size, head_dim], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    num_kv_heads, _, _, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != k_pages head_dim {kv_head_dim}")
    if q_heads % num_kv_heads:
        raise ValueError(f"num query heads {q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page tables must be an integer array, got {page_table.dtype}")


def check_ragged_args(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, soft_cap, sliding_window,
                      k_scales=None, v_scales=None, span_ends=None) -> None:
    """The ragged contract's shape and option checks (ValueError naming the input)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {q.shape}")
    validate_paged_inputs(q.shape[1], q.shape[2], k_pages, v_pages, page_tables)
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if page_tables.ndim != 2:
        raise ValueError(f"page_tables must be [num_seqs, max_pages], got {page_tables.shape}")
    num_seqs = page_tables.shape[0]
    if kv_lens.shape != (num_seqs,):
        raise ValueError(f"kv_lens must be [num_seqs={num_seqs}], got {kv_lens.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [num_seqs + 1={num_seqs + 1}], got {cu_q_lens.shape}")
    for name, x in (("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive number or None, got {soft_cap!r}")
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if span_ends is not None:
        if span_ends.shape != (q.shape[0],):
            raise ValueError(f"span_ends must be [tokens={q.shape[0]}] (one per query row), got {span_ends.shape}")
        if not jnp.issubdtype(span_ends.dtype, jnp.integer):
            raise ValueError(f"span_ends must be an integer array, got {span_ends.dtype}")


def last_visible_keys(span_ends: jax.Array | None, positions: jax.Array, kv_lens_of_rows: jax.Array) -> jax.Array:
    """Per query row, the last key position it sees (before the sliding window): its own position, or its
    span's end where that lies further, but never a key not yet in the cache (kv_len - 1 at most)."""
    if span_ends is None:
        return positions
    return jnp.maximum(positions, jnp.minimum(span_ends.astype(jnp.int32), kv_lens_of_rows - 1))


def token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array,
                                                                                      jax.Array]:
    """Per query row: (its sequence [T], its position [T], whether it is a real token [T])."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # The sequence of row j is the last s with cu_q_lens[s] <= j (empty sequences are skipped over).
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, rows, side="right") - 1, 0, kv_lens.shape[0] - 1)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (rows - cu_q_lens[seq])
    real = rows < cu_q_lens[-1]
    return seq.astype(jnp.int32), pos.astype(jnp.int32), real


def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                                     page_tables: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                                     soft_cap: float | None = None,
                                     sliding_window: int | None = None, k_scales: jax.Array | None = None,
                                     v_scales: jax.Array | None = None,
                                     span_ends: jax.Array | None = None) -> jax.Array:
    """Attention of a ragged batch of new tokens over each one's own sequence in the paged cache.

    The row at position p of a sequence holding kv_len tokens sees key position k iff
        k < kv_len  and  (k <= p  or  k <= span_ends[row])  and  (no window  or  p - k < sliding_window).
    This is transformers' Gemma 3 mask, layer by layer: full-attention layers OR the causal mask with the
    image blocks (`token_type_ids`), sliding layers AND that with `k > p - window`, which every later key of
    the image passes (k > p), while earlier keys of the image outside the window stay hidden, as here. The
    `k < kv_len` term matters only with spans: a prefill chunk that stops inside an image gives its image
    rows the image's keys written so far, never the unwritten rest (a caller that needs the whole image in
    view keeps an image within one chunk).

    Args:
      q: [tokens, num_heads, head_dim] queries, flat; sequence s owns rows cu_q_lens[s]..cu_q_lens[s+1]-1.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache, with this step's
        K/V already written.
      kv_lens: [num_seqs] int32 tokens in the cache per sequence after this step (its new ones included).
      page_tables: [num_seqs, max_pages] int32 page ids per sequence (unused entries: the null page 0).
      cu_q_lens: [num_seqs + 1] int32 non-decreasing query row offsets, cu_q_lens[0] = 0; a sequence with
        no rows (padding) attends nothing, and rows from cu_q_lens[-1] on are padding tokens.
      sm_scale: softmax scale (usually head_dim ** -0.5).
      soft_cap: optional logit soft-capping value (cap * tanh(s / cap)).
      sliding_window: optional window; a token at q_pos attends to keys with q_pos - k_pos < window.
      k_scales, v_scales: float32 scales of int8 / float8_e4m3fn pages, one per token and KV head, stored
        lane-dense ([num_kv_heads, ceil(num_pages * page_size / 128), 128], see `kv_quant`), or None
        (the default) for float pages.
      span_ends: optional [tokens] int32, per query row the last key position it sees besides the causal
        ones (Gemma 3: an image token's image's last position; -1, or any value <= the row's position, for
        no span). None (the default) is plain causal attention, compiled with no trace of spans.
    Returns:
      [tokens, num_heads, head_dim] in q's dtype; zeros for padding rows.
    """
    check_ragged_args(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, soft_cap, sliding_window,
                      k_scales, v_scales, span_ends)
    tokens, num_heads, head_dim = q.shape
    kvh, _, page_size, _ = k_pages.shape
    seq, pos, real = token_layout(cu_q_lens, kv_lens, tokens)
    last_key = last_visible_keys(span_ends, pos, kv_lens[seq])
    kv_pos = jnp.arange(page_tables.shape[1] * page_size)

    def gather(pages, scales, table):  # the row's pages as dense float32 [kvh, L, head_dim], dequantized
        dense = pages[:, table].reshape(kvh, -1, head_dim)
        if scales is None:
            return dense.astype(jnp.float32)
        return dequantize_kv(dense, page_scales(scales, table, page_size).reshape(kvh, -1))

    def one_row(q_t, seq_t, pos_t, last_t, real_t):
        table = page_tables[seq_t]
        k, v = gather(k_pages, k_scales, table), gather(v_pages, v_scales, table)
        visible = real_t & (kv_pos <= last_t) & (kv_pos < kv_lens[seq_t])
        if sliding_window is not None:
            visible &= pos_t - kv_pos < sliding_window
        qg = q_t.reshape(kvh, num_heads // kvh, head_dim).astype(jnp.float32)
        scores = jnp.einsum("kgd,kld->kgl", qg, k) * sm_scale
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        scores = jnp.where(visible, scores, MASK_VALUE)
        probs = jnp.where(visible, jax.nn.softmax(scores, axis=-1), 0.0)  # padding rows: all 0 -> output 0
        return jnp.einsum("kgl,kld->kgd", probs, v).reshape(num_heads, head_dim)

    return jax.vmap(one_row)(q, seq, pos, last_key, real).astype(q.dtype)
