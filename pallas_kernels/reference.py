"""Pure-`jnp` paged attention: the reference every kernel is tested against.

The KV cache of one layer is two arrays of pages, `[num_kv_heads, num_pages, page_size, head_dim]`.
A sequence owns a row of a page table; token `t` of the sequence lives in page
`page_table[t // page_size]` at offset `t % page_size`. Page 0 is the null page that padding points at.

1. `paged_decode_attention_reference`: one query token per slot, attending to the slot's first
   `lengths[b]` cached tokens (the new token's K/V is already written).
2. `paged_prefill_attention_reference`: a chunk of new tokens of one sequence whose K/V (and that of the
   earlier context) is already in the cache; causal inside the chunk, full over the prefix.

Both gather the slot's pages into a dense `[kv_len, head_dim]` view and run an ordinary masked softmax in
float32. They are the definition of correct, not fast: the gather materialises every page in the table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so a fully masked row (an idle slot) gives zeros instead of NaN.
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
        raise ValueError(f"page table must be an integer array, got {page_table.dtype}")


def _gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """[KVH, P, S, D] gathered by a [max_pages] table -> dense [KVH, max_pages * S, D]."""
    kvh, _, page_size, head_dim = pages.shape
    return pages[:, page_table].reshape(kvh, page_table.shape[0] * page_size, head_dim)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sm_scale: float,
            soft_cap: float | None) -> jax.Array:
    """q [T, H, D], k/v [KVH, L, D], mask [T, L] -> [T, H, D] (float32 math)."""
    t, h, d = q.shape
    kvh = k.shape[0]
    qg = q.reshape(t, kvh, h // kvh, d).astype(jnp.float32)
    scores = jnp.einsum("tkgd,kld->kgtl", qg, k.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[None, None], probs, 0.0)  # idle rows: all weights 0 -> output 0
    out = jnp.einsum("kgtl,kld->tkgd", probs, v.astype(jnp.float32))
    return out.reshape(t, h, d)


def _kv_mask(q_pos: jax.Array, kv_len: jax.Array, num_kv: int, sliding_window: int | None) -> jax.Array:
    """[T] query positions -> [T, num_kv] bool: causal, inside the valid length and the window."""
    kv_pos = jnp.arange(num_kv)[None, :]
    mask = (kv_pos <= q_pos[:, None]) & (kv_pos < kv_len)
    if sliding_window is not None:
        mask &= q_pos[:, None] - kv_pos < sliding_window
    return mask


def paged_decode_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     lengths: jax.Array, page_tables: jax.Array, *, sm_scale: float,
                                     soft_cap: float | None = None,
                                     sliding_window: int | None = None) -> jax.Array:
    """Attention of one new token per slot over its paged context.

    Args:
      q: [batch, num_heads, head_dim] queries; the token of slot b sits at position lengths[b] - 1.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache.
      lengths: [batch] int32 number of valid cached tokens per slot, the new one included; 0 = idle slot.
      page_tables: [batch, max_pages] int32 page ids per slot.
      sm_scale: softmax scale (usually head_dim ** -0.5).
      soft_cap: optional logit soft-capping value (cap * tanh(s / cap)).
      sliding_window: optional window; a token attends to keys with q_pos - k_pos < window.
    Returns:
      [batch, num_heads, head_dim] in q's dtype; zeros for idle slots.
    """
    validate_paged_inputs(q.shape[1], q.shape[2], k_pages, v_pages, page_tables)

    def one_slot(q_b, length, table):
        k = _gather_pages(k_pages, table)
        v = _gather_pages(v_pages, table)
        mask = _kv_mask((length - 1)[None], length, k.shape[1], sliding_window)
        return _attend(q_b[None], k, v, mask, sm_scale, soft_cap)[0]

    return jax.vmap(one_slot)(q, lengths, page_tables).astype(q.dtype)


def paged_prefill_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                      q_start: jax.Array, kv_len: jax.Array, page_table: jax.Array, *,
                                      sm_scale: float, soft_cap: float | None = None,
                                      sliding_window: int | None = None) -> jax.Array:
    """Attention of a chunk of one sequence's new tokens over its cache (prefix + the chunk itself).

    Args:
      q: [chunk, num_heads, head_dim]; row i is the token at position q_start + i.
      k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim] one layer's cache, with the
        chunk's own K/V already written.
      q_start: int32 scalar, position of the chunk's first token (= tokens already cached before it).
      kv_len: int32 scalar, q_start + number of real tokens in the chunk; rows past it are padding.
      page_table: [max_pages] int32 the sequence's page ids.
      sm_scale, soft_cap, sliding_window: as for decode.
    Returns:
      [chunk, num_heads, head_dim] in q's dtype; padding rows are zeros.
    """
    validate_paged_inputs(q.shape[1], q.shape[2], k_pages, v_pages, page_table)
    k = _gather_pages(k_pages, page_table)
    v = _gather_pages(v_pages, page_table)
    q_pos = q_start + jnp.arange(q.shape[0])
    mask = _kv_mask(q_pos, kv_len, k.shape[1], sliding_window) & (q_pos < kv_len)[:, None]
    return _attend(q, k, v, mask, sm_scale, soft_cap).astype(q.dtype)
