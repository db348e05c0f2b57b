"""Argument checks, block sizes and block math shared by the Pallas ragged paged-attention kernels.

Both kernel wrappers (`ragged_gpu`, `ragged_tpu`) do the same things before their `pallas_call`:
1. check the inputs against the ragged contract (`check_ragged_args` from the reference), raising
   `ValueError` that names the bad input, then check their own static block sizes (`check_block_q`);
2. pick a static key block of `pages_per_block` pages and pad the page tables with the null page 0 to a
   multiple of it, so a kernel never reads past the end of a table row;
3. pad small dimensions (query-group rows, token count) to what the backend's matmul wants.
Inside the kernels, `block_scores` and `online_softmax_step` are the flash-attention block math both
share; each kernel only decides which keys a row may see (`valid`) and where the running state lives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.reference import MASK_VALUE, check_ragged_args

__all__ = ["MASK_VALUE", "check_ragged_args", "check_block_q", "pick_pages_per_block", "pad_page_table",
           "round_up", "next_pow2", "is_pow2", "dot_precision", "tpu_interpret_params", "block_scores",
           "online_softmax_step"]


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def check_block_q(block_q, minimum: int = 1) -> None:
    """block_q (query tokens per tile) must be a static power of 2 >= minimum."""
    if not (isinstance(block_q, int) and is_pow2(block_q) and block_q >= minimum):
        raise ValueError(f"block_q must be a power of 2 >= {minimum}, got {block_q!r}")


def pick_pages_per_block(page_size: int, max_pages: int, requested: int | None, target_tokens: int,
                         min_tokens: int = 1) -> int:
    """Pages per compute block: the request, else enough pages for ~target_tokens keys (a power of 2),
    never fewer than min_tokens keys (Triton's dot needs N >= 16) and never more than the table rounded up."""
    if requested is not None:
        if not (isinstance(requested, int) and requested >= 1):
            raise ValueError(f"pages_per_compute_block must be a positive int, got {requested!r}")
        ppb = requested
    else:
        ppb = max(1, target_tokens // page_size)
        ppb = min(ppb, next_pow2(max_pages))
    while ppb * page_size < min_tokens:
        ppb *= 2
    return ppb


def pad_page_table(page_tables: jax.Array, multiple: int) -> jax.Array:
    """Pad the last axis with the null page 0 to a multiple of `multiple` (int32)."""
    page_tables = page_tables.astype(jnp.int32)
    pad = round_up(page_tables.shape[-1], multiple) - page_tables.shape[-1]
    if pad:
        widths = [(0, 0)] * (page_tables.ndim - 1) + [(0, pad)]
        page_tables = jnp.pad(page_tables, widths)
    return page_tables


def dot_precision(dtype):
    """Full-precision f32 matmuls (IEEE on Triton, multi-pass on TPU); the native path for 16-bit inputs."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def tpu_interpret_params(interpret):
    """`interpret` of a Mosaic kernel wrapper -> what `pallas_call` takes: False, or TPU interpret mode."""
    from jax.experimental.pallas import tpu as pltpu  # only the TPU kernel needs it
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams() if interpret else False


def block_scores(q: jax.Array, k: jax.Array, *, sm_scale: float, soft_cap: float | None, precision,
                 k_scale: jax.Array | None = None) -> jax.Array:
    """q [rows, D] against a key block k [block_k, D] -> float32 scores [rows, block_k], scaled and capped.

    Quantized pages: k holds the codes (already in q's dtype, an exact conversion) and k_scale [1, block_k]
    each key's scale, applied to the dot's result before the soft cap, which sees the true score.
    """
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    s = s * (sm_scale if k_scale is None else k_scale * sm_scale)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def online_softmax_step(acc, m_prev, l_prev, s, valid, v, precision, v_scale: jax.Array | None = None):
    """Fold one key block into the running softmax: acc [rows, D], max m and sum l [rows, 1] (float32).

    Masked keys get weight exactly 0 rather than exp(MASK - m): a row can meet a block it sees none of
    (window start, causal edge, a row of another sequence sharing the tile), and that block must leave
    its state unchanged. Quantized pages: v holds the codes and v_scale [1, block_k] their scales, folded
    into the weights of the value sum (the softmax sum l counts the unscaled weights).
    """
    s = jnp.where(valid, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(valid, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + p.sum(axis=1, keepdims=True)
    weights = p if v_scale is None else p * v_scale
    pv = lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return acc * alpha + pv, m_next, l_next
