"""The paged KV cache on the device: K and V pages per layer, and the scatter that writes new tokens.

1. `KVCache` holds, per layer, K and V pages `[num_kv_heads, num_pages, page_size, head_dim]`; the jitted
   steps take it donated and return the updated one.
2. `write_kv` scatters new tokens' K/V to flat slots (page * page_size + offset); padding tokens write to
   page 0, the reserved null page that nothing ever reads as real data. Which page ids a sequence holds
   is decided on the host (`jaxserve/scheduling/pages.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [num_kv_heads, num_pages, page_size, head_dim]
    v: list[jax.Array]  # per layer [num_kv_heads, num_pages, page_size, head_dim]

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
              dtype) -> "KVCache":
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        return cls(k=[jnp.zeros(shape, dtype) for _ in range(num_layers)],
                   v=[jnp.zeros(shape, dtype) for _ in range(num_layers)])

    @property
    def num_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             write_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k, v [N, KVH, D] written at flat slots write_index [N] of pages [KVH, P, S, D]."""
    kvh, num_pages, page_size, head_dim = k_pages.shape

    def scatter(pages, new):
        flat = pages.reshape(kvh, num_pages * page_size, head_dim)
        flat = flat.at[:, write_index].set(new.transpose(1, 0, 2).astype(pages.dtype))
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)
