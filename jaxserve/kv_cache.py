"""Paged KV cache: physical pages on device, a logical page allocator on the host.

1. `KVCache` holds, per layer, K and V pages `[num_kv_heads, num_pages, page_size, head_dim]`; the jitted
   steps take it donated and return the updated one.
2. `write_kv` scatters new tokens' K/V to flat slots (page * page_size + offset); padding tokens write to
   page 0, the reserved null page that nothing ever reads as real data.
3. `PageAllocator` (host only) hands out page ids. It answers "can I?" before it mutates, so running
   out is a normal answer, never a half-done allocation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NULL_PAGE = 0


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


class PageAllocator:
    """Free list of KV pages, page 0 excluded. Host-side and single-threaded (the engine loop owns it)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None (and nothing taken) when fewer than n are free."""
        if not self.can_allocate(n):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page == NULL_PAGE:
                raise ValueError("the null page is never allocated and cannot be freed")
        self._free.extend(reversed(pages))


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
