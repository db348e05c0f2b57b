"""Quantized KV pages: int8 or fp8 (e4m3) codes with one float32 scale per token and KV head beside them.

The format every attention implementation reads and the write side produces:
1. A layer's pages keep their shape, `[num_kv_heads, num_pages, page_size, head_dim]`, in int8 or
   float8_e4m3fn; its scales are `[num_kv_heads, num_pages, page_size]` float32, one per cached token
   and KV head, at the same (head, page, offset) as the token's codes.
2. `quantize_kv_tokens` maps one token's head vector x [head_dim] to codes c and scale s with
   s = absmax(x) / QMAX (127 for int8, 448 for e4m3, the largest finite value), so x ~= c * s and the
   largest element uses the whole code range. An all-zero vector gets s = 0 and codes 0.
3. Readers never build a float copy of the cache: q . (c * s) = (q . c) * s, so scores are the dot
   with the codes times the key's scale, and sum_j p_j (c_j * s_j) = sum_j (p_j * s_j) c_j, so the value
   sum folds the value scale into the probabilities. Codes convert exactly to bf16 / f32 (int8 and e4m3
   both fit in bf16's 8-bit significand), so the only error is the quantization itself.
Float pages pass no scales (None): that path is unchanged, the same programs as before quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.dtype(jnp.float32)


def kv_quant_dtype(name: str):
    """`--kv-cache-dtype` value -> page dtype of quantized pages, or None for "auto" (float pages)."""
    if name == "auto":
        return None
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_CACHE_DTYPES]}, got {name!r}")
    return KV_CACHE_DTYPES[name]


def is_quantized_dtype(dtype) -> bool:
    return jnp.dtype(dtype) in QMAX


def symmetric_codes(x: jax.Array, absmax: jax.Array, qmax: float, dtype) -> tuple[jax.Array, jax.Array]:
    """Codes of float32 x in `dtype` (integer: rounded; float8: cast) and the scales absmax / qmax, absmax
    broadcasting against x; where absmax is 0 the scale and the codes are 0. Shared with the weights'
    quantizer (`jaxserve.quantization`)."""
    scale = absmax / qmax
    inv = jnp.where(absmax > 0, qmax / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    # Clip before the cast: x * inv can overshoot qmax by an ulp, and e4m3fn has no infinity (it gives NaN).
    scaled = jnp.clip(x * inv, -qmax, qmax)
    codes = scaled.astype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.round(scaled).astype(dtype)
    return codes, scale


def quantize_kv_tokens(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x [..., head_dim] (any float) -> (codes [..., head_dim] in `dtype`, scales [...] float32)."""
    dtype = jnp.dtype(dtype)
    if dtype not in QMAX:
        raise ValueError(f"KV pages quantize to int8 or float8_e4m3fn, not {dtype}")
    x = x.astype(jnp.float32)
    codes, scale = symmetric_codes(x, jnp.max(jnp.abs(x), axis=-1, keepdims=True), QMAX[dtype], dtype)
    return codes, scale[..., 0].astype(SCALE_DTYPE)


def dequantize_kv(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """codes [..., head_dim] and scales [...] -> float32 [..., head_dim] (the reference's and tests' view)."""
    return codes.astype(jnp.float32) * scales.astype(jnp.float32)[..., None]


def check_kv_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """Quantized pages come with both scale arrays, float pages with neither (ValueError naming the input)."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales come together: give both (quantized pages) or neither")
    if k_scales is None:
        if is_quantized_dtype(k_pages.dtype) or is_quantized_dtype(v_pages.dtype):
            raise ValueError(f"{k_pages.dtype} KV pages need k_scales and v_scales")
        return
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not is_quantized_dtype(pages.dtype):
            raise ValueError(f"{name} with scales must be int8 or float8_e4m3fn, got {pages.dtype}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.shape != k_pages.shape[:3]:
            raise ValueError(f"{name} must be [num_kv_heads, num_pages, page_size]={k_pages.shape[:3]}, "
                             f"got {scales.shape}")
        if not jnp.issubdtype(scales.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {scales.dtype}")


def kv_token_bytes(num_kv_heads: int, head_dim: int, page_dtype) -> int:
    """Bytes one cached token costs in one layer, K and V, scales included (for the KV budget)."""
    scale = SCALE_DTYPE.itemsize if is_quantized_dtype(page_dtype) else 0
    return 2 * num_kv_heads * (head_dim * np.dtype(page_dtype).itemsize + scale)
