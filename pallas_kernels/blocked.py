"""Ragged paged attention in blocked `jnp`: the CPU's default, whose work follows the real KV lengths.

Same contract as `ragged_paged_attention_reference`. The reference gathers every page of a table row for
every query row; here the loops run over key blocks (`pages_per_block` pages) with trip counts computed
on device from the batch's real lengths, so a step costs what its sequences hold, not
`sequences x max_model_len`. The rows split into two kinds, each laid out for its own shape of work:

1. Single-row sequences (decodes): one query row per sequence, all sequences at once. Each loop step
   gathers one key block per sequence (`[kv_heads, seqs, block_k, head_dim]`) and folds it into an online
   softmax; the loop ends at the longest decoding sequence.
2. Multi-row sequences (prefill chunks): cut into windows of `query_window` rows of one sequence. A loop
   over the windows (however many the batch has) runs, per window, a loop over that sequence's key
   blocks up to the causal edge of its last row (and from the sliding window's start), so a block of keys
   is gathered once for a whole window of queries. Results go back into the window's rows only.
   With `span_ends` (bidirectional spans, e.g. Gemma 3's images) a window's keys run to the furthest
   key any of its rows sees; single-row sequences need no span work: their row is their last key.
Padding rows are never written and stay zero. All math is float32. Quantized pages (`kv_quant.py`): each
gathered block is converted from its codes and the per-key scales multiply the scores and the value
weights, so no float copy of the cache is ever made.

`decode_products` says how the decode rows' small per-sequence products run: "dot" (batched `einsum`s,
which XLA:CPU gives YNNPACK by default) or "multiply_sum" (elementwise products and sums, which stay in
YNNPACK's reduce fusions when a step program's dots are compiled for Eigen: XLA's batched dots there
took 1.7x as long for 16 sequences; see jaxserve/execution/cpu_matmuls.py and docs/performance.md).
Steps of fewer than `MULTIPLY_SUM_MIN_SEQS` sequence rows keep the dots, faster there in both libraries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_quant import page_scales
from pallas_kernels.reference import MASK_VALUE, check_ragged_args, last_visible_keys

MULTIPLY_SUM_MIN_SEQS = 4  # 12 layers of 1 decode row: 1.3-1.45 ms as dots, 1.8 ms as multiply-and-sum


def _attend_block(carry, q, k, v, valid, *, spec: str, sm_scale, soft_cap, k_scale=None, v_scale=None,
                  products: str = "dot"):
    """Fold one key block into the running softmax (acc [..., D], max m and sum l [..., 1], float32).

    `spec` names q's and k's axes for einsum ("skgd,skld" or "kwgd,kld"): the scores are q's axes with
    d replaced by the key axis l; `valid` broadcasts against them, and so do the per-key scales of
    quantized pages (k and v then hold the codes, see `kv_quant`). `products`: "dot" or, for the decode
    spec, "multiply_sum" (see the module's docstring).
    """
    acc, m, l = carry
    q_axes, k_axes = spec.split(",")
    s_axes = q_axes[:-1] + "l"
    multiply_sum = products == "multiply_sum"
    if multiply_sum:  # q [K, S, G, D] x k [K, S, L, D]: the sum over d of their broadcast product
        s = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)
    else:
        s = jnp.einsum(f"{spec}->{s_axes}", q, k)
    s = s * (sm_scale if k_scale is None else k_scale * sm_scale)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid, s, MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next), 0.0)  # a row that sees nothing here stays unchanged
    weights = p if v_scale is None else p * v_scale
    if multiply_sum:  # weights [K, S, G, L] x v [K, S, L, D]: the sum over l
        pv = (weights[..., None] * v[:, :, None, :, :]).sum(-2)
    else:
        pv = jnp.einsum(f"{s_axes},{k_axes}->{q_axes}", weights, v)
    return acc * alpha + pv, m_next, l * alpha + p.sum(-1, keepdims=True)


def _init(shape, head_dim):
    return (jnp.zeros(shape + (head_dim,), jnp.float32), jnp.full(shape + (1,), MASK_VALUE, jnp.float32),
            jnp.zeros(shape + (1,), jnp.float32))


def _finish(acc, l):
    return acc / jnp.where(l > 0, l, 1.0)


def _gather_block(pages, scales, ids, shape, scale_axes):
    """One key block of `pages` at page ids `ids` as float32 `shape`, and for quantized pages its scales
    [..., block_k] expanded at `scale_axes` to broadcast against the scores (None for float pages)."""
    block = pages[:, ids].reshape(shape).astype(jnp.float32)
    if scales is None:
        return block, None
    return block, jnp.expand_dims(page_scales(scales, ids, pages.shape[2]).reshape(shape[:-1]), scale_axes)


def _decode_rows(q, kv, kv_lens, tables, cu_q_lens, *, ppb, sm_scale, soft_cap, sliding_window, products):
    """Rows of sequences with exactly one query: [num_seqs, H, D] results and their row indices."""
    k_pages, v_pages, k_scales, v_scales = kv
    num_seqs = kv_lens.shape[0]
    products = products if num_seqs >= MULTIPLY_SUM_MIN_SEQS else "dot"
    scoring = dict(sm_scale=sm_scale, soft_cap=soft_cap, products=products)
    kvh, _, page_size, head_dim = k_pages.shape
    block_k = ppb * page_size
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    row = jnp.minimum(cu_q_lens[:-1], q.shape[0] - 1)
    lens = jnp.where(q_len == 1, kv_lens, 0)
    # [KVH, S, G, D]: the layout the gathered key blocks come in, so no block is ever transposed.
    qd = q[row].reshape(num_seqs, kvh, -1, head_dim).swapaxes(0, 1).astype(jnp.float32)
    first_key = jnp.zeros_like(lens) if sliding_window is None else jnp.maximum(lens - sliding_window, 0)
    start_blk = jnp.min(jnp.where(lens > 0, first_key, jnp.iinfo(jnp.int32).max)) // block_k
    end_blk = (jnp.max(lens) + block_k - 1) // block_k

    def body(blk, carry):
        ids = lax.dynamic_slice_in_dim(tables, blk * ppb, ppb, axis=1)  # [S, ppb]
        shape = (kvh, num_seqs, block_k, head_dim)
        k, k_scale = _gather_block(k_pages, k_scales, ids, shape, 2)
        v, v_scale = _gather_block(v_pages, v_scales, ids, shape, 2)
        pos = blk * block_k + jnp.arange(block_k)
        valid = (pos[None] < lens[:, None]) & (pos[None] >= first_key[:, None])  # [S, block_k]
        return _attend_block(carry, qd, k, v, valid[None, :, None], spec="ksgd,ksld", k_scale=k_scale,
                             v_scale=v_scale, **scoring)

    acc, _, l = lax.fori_loop(jnp.minimum(start_blk, end_blk), end_blk, body,
                              _init(qd.shape[:3], head_dim))
    out = _finish(acc, l).swapaxes(0, 1).reshape(num_seqs, -1, head_dim)
    return out, jnp.where(q_len == 1, row, q.shape[0])  # out-of-range index: dropped by the scatter


def _chunk_rows(out, q, kv, kv_lens, tables, cu_q_lens, span_ends, *, ppb, window, sm_scale, soft_cap,
                sliding_window):
    """Rows of sequences with several queries, a window of `window` rows of one sequence at a time."""
    scoring = dict(sm_scale=sm_scale, soft_cap=soft_cap)
    k_pages, v_pages, k_scales, v_scales = kv
    tokens, num_heads, _ = q.shape
    kvh, _, page_size, head_dim = k_pages.shape
    block_k = ppb * page_size
    q_len = cu_q_lens[1:] - cu_q_lens[:-1]
    windows = jnp.where(q_len > 1, (q_len + window - 1) // window, 0)
    windows_end = jnp.cumsum(windows)

    def one_window(i, out):
        s = jnp.searchsorted(windows_end, i, side="right")
        first_row = cu_q_lens[s] + (i - (windows_end[s] - windows[s])) * window
        end_row = jnp.minimum(first_row + window, cu_q_lens[s + 1])
        start = jnp.minimum(first_row, tokens - window)  # what dynamic_slice would clamp to, made explicit
        rows = start + jnp.arange(window)
        mine = (rows >= first_row) & (rows < end_row)
        offset = kv_lens[s] - q_len[s] - cu_q_lens[s]  # position of row j is j + offset
        q_pos = rows + offset
        # Each row's last key: its own position, or with spans its span's end where that lies further.
        last_key = q_pos if span_ends is None else last_visible_keys(
            lax.dynamic_slice_in_dim(span_ends, start, window), q_pos, kv_lens[s])
        qw = lax.dynamic_slice_in_dim(q, start, window).reshape(window, kvh, -1, head_dim)
        qw = qw.swapaxes(0, 1).astype(jnp.float32)  # [KVH, W, G, D]
        first_key = 0 if sliding_window is None else jnp.maximum(first_row + offset - sliding_window + 1, 0)
        table = tables[s]

        def body(blk, carry):
            ids = lax.dynamic_slice_in_dim(table, blk * ppb, ppb)
            k, k_scale = _gather_block(k_pages, k_scales, ids, (kvh, block_k, head_dim), (1, 2))
            v, v_scale = _gather_block(v_pages, v_scales, ids, (kvh, block_k, head_dim), (1, 2))
            k_pos = blk * block_k + jnp.arange(block_k)
            valid = mine[:, None] & (k_pos[None] <= last_key[:, None])  # [W, block_k]
            if sliding_window is not None:
                valid &= q_pos[:, None] - k_pos[None] < sliding_window
            return _attend_block(carry, qw, k, v, valid[None, :, None], spec="kwgd,kld", k_scale=k_scale,
                                 v_scale=v_scale, **scoring)

        # The key blocks run to the window's furthest last key: its last row's position, unless a span reaches on.
        last_pos = end_row - 1 + offset if span_ends is None else jnp.max(jnp.where(mine, last_key, 0))
        acc, _, l = lax.fori_loop(first_key // block_k, last_pos // block_k + 1, body,
                                  _init(qw.shape[:3], head_dim))
        result = _finish(acc, l).swapaxes(0, 1).reshape(window, num_heads, head_dim).astype(out.dtype)
        current = lax.dynamic_slice_in_dim(out, start, window)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None, None], result, current), start, 0)

    return lax.fori_loop(0, windows_end[-1], one_window, out)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "pages_per_block",
                                             "query_window", "decode_products"))
def ragged_paged_attention_blocked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                                   page_tables: jax.Array, cu_q_lens: jax.Array, *, sm_scale: float,
                                   soft_cap: float | None = None, sliding_window: int | None = None,
                                   pages_per_block: int | None = None, query_window: int = 32,
                                   k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                                   decode_products: str = "dot", span_ends: jax.Array | None = None) -> jax.Array:
    """Blocked jnp ragged paged attention; same contract as `ragged_paged_attention_reference`.

    Args:
      q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, sm_scale, soft_cap, sliding_window, k_scales,
        v_scales, span_ends: as for `ragged_paged_attention_reference`.
      pages_per_block: pages per key block (static; default: about 64 keys).
      query_window: query rows of one prefill sequence handled together (static; capped at the tokens).
      decode_products: "dot" or "multiply_sum", how the decode rows' products run (static; see above).
    Returns:
      [tokens, num_heads, head_dim] in q's dtype; zeros for padding rows.
    """
    check_ragged_args(q, k_pages, v_pages, kv_lens, page_tables, cu_q_lens, soft_cap, sliding_window,
                      k_scales, v_scales, span_ends)
    page_size = k_pages.shape[2]
    ppb = pages_per_block or max(1, 64 // page_size)
    max_pages = page_tables.shape[1]
    ppb = min(ppb, max_pages)
    tables = page_tables.astype(jnp.int32)
    pad = -max_pages % ppb
    if pad:  # every key block is a whole slice of the table; the extra entries are the null page
        tables = jnp.pad(tables, ((0, 0), (0, pad)))
    kv_lens, cu_q_lens = kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32)
    common = dict(sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    kv = (k_pages, v_pages, k_scales, v_scales)
    if decode_products not in ("dot", "multiply_sum"):
        raise ValueError(f"decode_products must be 'dot' or 'multiply_sum', got {decode_products!r}")
    rows_out, rows = _decode_rows(q, kv, kv_lens, tables, cu_q_lens, ppb=ppb, products=decode_products, **common)
    out = jnp.zeros(q.shape, q.dtype).at[rows].set(rows_out.astype(q.dtype), mode="drop")
    return _chunk_rows(out, q, kv, kv_lens, tables, cu_q_lens, span_ends, ppb=ppb,
                       window=min(query_window, q.shape[0]), **common)
