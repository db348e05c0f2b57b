"""Quantized KV pages: int8 or fp8 (e4m3) codes with one float32 scale per token and KV head beside them.

The format every attention implementation reads and the write side produces:
1. A layer's pages keep their shape, `[num_kv_heads, num_pages, page_size, head_dim]`, in int8 or
   float8_e4m3fn. Its scales are float32, one per cached token and KV head, stored lane-dense:
   `[num_kv_heads, scale_rows, SCALE_LANES]` (`scales_shape`), the scale of the token at flat slot
   t = page * page_size + offset at `[head, t // SCALE_LANES, t % SCALE_LANES]`, so a page's scales are
   page_size consecutive values of one row (page sizes are powers of 2) or whole rows.
   Why not `[num_kv_heads, num_pages, page_size]`: a TPU tiles an array's last two dimensions by
   (8, 128), so a 16-token page's scales would fill 16 of a tile row's 128 lanes. XLA stores a step
   argument compactly, the Mosaic kernel pins the padded layout, and the compiled v6e step copied every
   layer's scales between the two (0.6 GB of temp memory for an 8-layer Llama-3-8B-shaped int8 cache,
   27% of it); 128 lanes fill the tile row, both layouts are the same, and nothing is copied.
2. `quantize_kv_tokens` maps one token's head vector x [head_dim] to codes c and scale s with
   s = absmax(x) / QMAX (127 for int8, 448 for e4m3, the largest finite value), so x ~= c * s and the
   largest element uses the whole code range. An all-zero vector gets s = 0 and codes 0.
3. Readers never build a float copy of the cache: q . (c * s) = (q . c) * s, so scores are the dot
   with the codes times the key's scale, and sum_j p_j (c_j * s_j) = sum_j (p_j * s_j) c_j, so the value
   sum folds the value scale into the probabilities. Codes convert exactly to bf16 / f32 (int8 and e4m3
   both fit in bf16's 8-bit significand), so the only error is the quantization itself. The `jnp`
   readers take a block's scales with `page_scales`.
Float pages pass no scales (None): that path is unchanged, the same programs as before quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

KV_CACHE_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
SCALE_DTYPE = jnp.dtype(jnp.float32)
SCALE_LANES = 128  # scales per row: a TPU tile row of 32-bit values
SCALE_ROW_MULTIPLE = 8  # rows: a whole number of float32 tiles (8 sublanes), see `scales_shape`


def scales_shape(num_kv_heads: int, num_pages: int, page_size: int) -> tuple[int, int, int]:
    """The lane-dense scales of `num_pages` pages of `page_size` tokens: the rows their slots fill, rounded
    up to whole (8, 128) tiles (the rest zeros). Whole tiles leave XLA no padding to save by choosing
    another layout: with 8257 rows it put the heads axis inside them, and the kernel's pinned default
    layout cost a copy of the scales at every scanned layer."""
    rows = -(-num_pages * page_size // SCALE_LANES)
    return num_kv_heads, -(-rows // SCALE_ROW_MULTIPLE) * SCALE_ROW_MULTIPLE, SCALE_LANES


def lane_dense_scales(token_scales: jax.Array) -> jax.Array:
    """Scales laid out by page, [num_kv_heads, num_pages, page_size] -> the stored `scales_shape`."""
    kvh, num_pages, page_size = token_scales.shape
    flat = token_scales.reshape(kvh, num_pages * page_size)
    rows = scales_shape(kvh, num_pages, page_size)[1]
    return jnp.pad(flat, ((0, 0), (0, rows * SCALE_LANES - flat.shape[1]))).reshape(kvh, rows, SCALE_LANES)


def page_scales(scales: jax.Array, page_ids: jax.Array, page_size: int) -> jax.Array:
    """The stored scales of pages `page_ids` (any shape) -> [num_kv_heads, *page_ids.shape, page_size].
    Pages fill whole rows or whole shares of one (`check_kv_scales`), so the rows are a free view of
    whole pages (the last row's padding some pages past the end) and this is a gather of rows."""
    return scales.reshape(scales.shape[0], -1, page_size)[:, page_ids]


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
    page_size = k_pages.shape[2]
    if SCALE_LANES % page_size and page_size % SCALE_LANES:
        raise ValueError(f"quantized pages need a page_size that divides {SCALE_LANES} or is a multiple of "
                         f"it (a power of 2), got {page_size}")
    want = scales_shape(*k_pages.shape[:3])
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.shape != want:
            raise ValueError(f"{name} must be [num_kv_heads, ceil(num_pages * page_size / {SCALE_LANES}), "
                             f"{SCALE_LANES}]={want}, got {scales.shape}")
        if not jnp.issubdtype(scales.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array, got {scales.dtype}")


def kv_token_bytes(num_kv_heads: int, head_dim: int, page_dtype) -> int:
    """Bytes one cached token costs in one layer, K and V, scales included (for the KV budget)."""
    scale = SCALE_DTYPE.itemsize if is_quantized_dtype(page_dtype) else 0
    return 2 * num_kv_heads * (head_dim * np.dtype(page_dtype).itemsize + scale)
