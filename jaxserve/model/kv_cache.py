"""The paged KV cache on the device: K and V pages per layer, and the scatter that writes new tokens.

1. `KVCache` holds, per layer, K and V pages `[num_kv_heads, num_pages, page_size, head_dim]`; the jitted
   steps take it donated and return the updated one. With `--kv-cache-dtype int8|fp8` each layer's K and
   V are `QuantizedPages`: int8 / e4m3 codes of that shape plus float32 scales `[num_kv_heads, num_pages,
   page_size]`, one per token and KV head (`pallas_kernels/kv_quant.py`). Both are pytrees, so donation,
   sharding specs and the pipeline carry treat the scales exactly like the pages.
2. `write_kv` scatters new tokens' K/V to flat slots (page * page_size + offset); padding tokens write to
   page 0, the reserved null page that nothing ever reads as real data. Quantized pages are written by
   `write_kv_quantized` (codes and scales at the same slots). Which page ids a sequence holds is decided
   on the host (`jaxserve/scheduling/pages.py`); a page's bytes depend only on its own tokens, so the
   prefix cache and preemption need nothing new for quantized pages.
3. `attention_operands` unpacks a layer's pages for an attention backend: the codes as the pages, the
   scales as `k_scales` / `v_scales`; float pages pass no scales (the float programs are unchanged).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.quantization.kv_write import write_kv_quantized
from pallas_kernels.kv_quant import SCALE_DTYPE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedPages:
    codes: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim] int8 | float8_e4m3fn
    scales: jax.Array  # [num_kv_heads, num_pages, page_size] float32, one per token and KV head

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list  # per layer: pages [num_kv_heads, num_pages, page_size, head_dim], or QuantizedPages
    v: list  # per layer: the same

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
              dtype, page_dtype=None) -> "KVCache":
        """Float pages of `dtype`, or quantized pages of `page_dtype` (int8 / float8_e4m3fn) when given."""
        shape = (num_kv_heads, num_pages, page_size, head_dim)

        def pages():
            if page_dtype is None:
                return jnp.zeros(shape, dtype)
            return QuantizedPages(jnp.zeros(shape, page_dtype), jnp.zeros(shape[:3], SCALE_DTYPE))

        return cls(k=[pages() for _ in range(num_layers)], v=[pages() for _ in range(num_layers)])

    @property
    def num_bytes(self) -> int:
        return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(self))

    @property
    def quantized(self) -> bool:
        return bool(self.k) and isinstance(self.k[0], QuantizedPages)


def write_kv(k_pages, v_pages, k: jax.Array, v: jax.Array, write_index: jax.Array):
    """k, v [N, KVH, D] written at flat slots write_index [N] of pages [KVH, P, S, D] (float arrays or
    `QuantizedPages`, which quantize each new token per KV head); returns the updated pages."""
    if isinstance(k_pages, QuantizedPages):
        k_codes, v_codes, k_scales, v_scales = write_kv_quantized(k_pages.codes, v_pages.codes, k_pages.scales,
                                                                  v_pages.scales, k, v, write_index)
        return QuantizedPages(k_codes, k_scales), QuantizedPages(v_codes, v_scales)
    kvh, num_pages, page_size, head_dim = k_pages.shape

    def scatter(pages, new):
        flat = pages.reshape(kvh, num_pages * page_size, head_dim)
        flat = flat.at[:, write_index].set(new.transpose(1, 0, 2).astype(pages.dtype))
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)


def attention_operands(k_pages, v_pages) -> tuple[jax.Array, jax.Array, dict]:
    """(k pages, v pages, extra keyword arguments) for an attention backend's `ragged`."""
    if isinstance(k_pages, QuantizedPages):
        return k_pages.codes, v_pages.codes, {"k_scales": k_pages.scales, "v_scales": v_pages.scales}
    return k_pages, v_pages, {}
