"""The write side of quantized KV pages: quantize a step's new K/V on device and scatter codes and scales.

1. The step computes each new token's K and V heads in float ([N, num_kv_heads, head_dim]).
2. `write_kv_quantized` quantizes every (token, head) vector on its own (`quantize_kv_tokens`: scale =
   absmax / 127 for int8, absmax / 448 for e4m3) and scatters the codes into the pages and the scales
   into the scale arrays at the same flat slots (page * page_size + offset) as `write_kv` does for float
   pages; padding tokens' slots are on the null page 0, which nothing reads as real data.
3. The attention backends read the codes and fold the scales into their math (`pallas_kernels.kv_quant`).
Quantizing per token at write time needs no calibration and never rescales what is already cached, so a
page's bytes depend only on its tokens: prefix-cache sharing and preemption work on it unchanged.
"""

from __future__ import annotations

import jax

from pallas_kernels.kv_quant import check_kv_scales, quantize_kv_tokens
from pallas_kernels.page_write import write_token_rows


def write_kv_quantized(k_pages: jax.Array, v_pages: jax.Array, k_scales: jax.Array, v_scales: jax.Array,
                       k: jax.Array, v: jax.Array, write_index: jax.Array
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """k, v [N, KVH, D] (float) quantized per token and head into pages [KVH, P, S, D] (int8 or
    float8_e4m3fn) and scales [KVH, P, S] at flat slots write_index [N]; returns the four updated arrays."""
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)

    def scatter(pages, scales, new):
        codes, token_scales = quantize_kv_tokens(new, pages.dtype)  # [N, KVH, D], [N, KVH]
        return write_token_rows(pages, write_index, codes), write_token_rows(scales, write_index, token_scales)

    k_pages, k_scales = scatter(k_pages, k_scales, k)
    v_pages, v_scales = scatter(v_pages, v_scales, v)
    return k_pages, v_pages, k_scales, v_scales
