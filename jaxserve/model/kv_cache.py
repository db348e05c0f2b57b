"""The paged KV cache on the device: K and V pages of every layer, and the scatter that writes new tokens.

1. `KVCache` holds K and V pages `[num_kv_heads, num_pages, page_size, head_dim]` in one of two layouts:
   - unrolled layers (`jaxserve/model/layer_loop.py`): a list with one array per layer;
   - layers under `lax.scan`: one array for all layers, `[num_kv_heads, num_layers * num_pages, page_size,
     head_dim]`, layer i's block of pages from i * num_pages on (each block has its own null page). The
     scan carries it and a layer reaches its block by offsetting the step's page ids and write slots
     (`for_layer`): a traced layer index costs one add, never a copy of a layer's pages.
   Not one layout for both: when unrolled layers scatter into one shared array, XLA:CPU copies the whole
   array at every layer (16 layers of the 124.7M model's width decoded a token in 1.5 s against 28 ms,
   docs/performance.md), while a scan's carry is updated in place. The jitted steps take the cache
   donated and return the updated one. With `--kv-cache-dtype int8|fp8` the pages are `QuantizedPages`:
   int8 / e4m3 codes of that shape plus float32 scales, one per token and KV head, 128 to a row in slot
   order (`pallas_kernels/kv_quant.py`). Both are pytrees, so donation, sharding specs and the pipeline
   carry treat the scales like the pages.
2. `write_kv` scatters new tokens' K/V to flat slots (page * page_size + offset), in the form the compiling
   platform updates in place (`pallas_kernels/page_write.py`); padding tokens write to
   page 0 (of the layer's block), the reserved null page that nothing ever reads as real data. Quantized
   pages are written by `write_kv_quantized` (codes and scales at the same slots). Which page ids a
   sequence holds is decided on the host (`jaxserve/scheduling/pages.py`), the same for every layer; a
   page's bytes depend only on its own tokens, so the prefix cache and preemption need nothing new for
   quantized pages.
3. `attention_operands` unpacks a layer's pages for an attention backend: the codes as the pages, the
   scales as `k_scales` / `v_scales`; float pages pass no scales (the float programs are unchanged).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve.quantization.kv_write import write_kv_quantized
from pallas_kernels.kv_quant import scales_shape
from pallas_kernels.page_write import write_token_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedPages:
    codes: jax.Array  # [num_kv_heads, num_pages, page_size, head_dim] int8 | float8_e4m3fn
    scales: jax.Array  # [num_kv_heads, rows, 128] float32, one per token and KV head (`kv_quant.scales_shape`)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def dtype(self):
        return self.codes.dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list | jax.Array | QuantizedPages  # per layer [KVH, P, S, D], or every layer's block: [KVH, L * P, S, D]
    v: list | jax.Array | QuantizedPages  # the same
    num_layers: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def abstract(cls, pages, num_layers: int, folded: bool) -> "KVCache":
        """The shapes of a cache whose every layer has `pages` (a [KVH, P, S, D] jax.ShapeDtypeStruct, or
        QuantizedPages of them); `folded`: one array of every layer's block (layers under `lax.scan`)."""
        if not folded:
            return cls([pages] * num_layers, [pages] * num_layers, num_layers=num_layers)
        like = lambda a, shape: jax.ShapeDtypeStruct(shape, a.dtype, sharding=a.sharding)
        codes = pages.codes if isinstance(pages, QuantizedPages) else pages
        kvh, num_pages, *rest = codes.shape
        folded_pages = like(codes, (kvh, num_layers * num_pages, *rest))
        if isinstance(pages, QuantizedPages):  # the scales of every layer's pages, lane-dense as one layer's
            folded_pages = QuantizedPages(folded_pages, like(pages.scales, scales_shape(*folded_pages.shape[:3])))
        return cls(folded_pages, folded_pages, num_layers=num_layers)

    @property
    def folded(self) -> bool:
        return not isinstance(self.k, list)

    @property
    def _some_pages(self):
        """Pages that stand for every layer's: the folded array, or the first layer's."""
        return self.k if self.folded else self.k[0]

    @property
    def page_dtype(self):
        return self._some_pages.dtype

    @property
    def num_bytes(self) -> int:
        return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(self))

    @property
    def quantized(self) -> bool:
        return isinstance(self._some_pages, QuantizedPages)

    def for_layer(self, layer, write_index: jax.Array, attend):
        """Of a folded cache: layer `layer`'s (an int, or a traced int32 under `lax.scan`) write slots and
        attention, the step's page ids and slots moved into the layer's block of pages."""
        num_pages, page_size = self.k.shape[1] // self.num_layers, self.k.shape[2]
        first_page = layer * num_pages
        return write_index + first_page * page_size, functools.partial(attend, first_page=first_page)


def write_kv(k_pages, v_pages, k: jax.Array, v: jax.Array, write_index: jax.Array):
    """k, v [N, KVH, D] written at flat slots write_index [N] of pages [KVH, P, S, D] (float arrays or
    `QuantizedPages`, which quantize each new token per KV head); returns the updated pages."""
    if isinstance(k_pages, QuantizedPages):
        k_codes, v_codes, k_scales, v_scales = write_kv_quantized(k_pages.codes, v_pages.codes, k_pages.scales,
                                                                  v_pages.scales, k, v, write_index)
        return QuantizedPages(k_codes, k_scales), QuantizedPages(v_codes, v_scales)
    return write_token_rows(k_pages, write_index, k), write_token_rows(v_pages, write_index, v)


def attention_operands(k_pages, v_pages) -> tuple[jax.Array, jax.Array, dict]:
    """(k pages, v pages, extra keyword arguments) for an attention backend's `ragged`."""
    if isinstance(k_pages, QuantizedPages):
        return k_pages.codes, v_pages.codes, {"k_scales": k_pages.scales, "v_scales": v_pages.scales}
    return k_pages, v_pages, {}
