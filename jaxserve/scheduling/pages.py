"""KV pages on the host: which page ids a sequence holds, counted per user (no device arrays here).

1. `PageAllocator` hands out page ids and counts each page's users. It answers "can I?" before it
   mutates, so running out is a normal answer, never a half-done allocation. Page 0 is the reserved null
   page that padding tokens write to; it is never handed out or freed.
2. With a `PrefixCache`, a page whose last user lets go stays cached (idle) if it holds a registered
   prefix; `allocate` takes never-cached free pages first and only then evicts the least recently used
   idle page. Idle pages count as free: they can be taken at any moment.
3. The pages themselves (K and V per layer) live on the device: `jaxserve/model/kv_cache.py`.
"""

from __future__ import annotations

import collections

from jaxserve.scheduling.prefix_cache import PrefixCache

NULL_PAGE = 0


class PageAllocator:
    """Free list and reference counts of KV pages, page 0 excluded. Host-side and single-threaded (the
    engine loop owns it). Pages shared through the prefix cache have one reference per request."""

    def __init__(self, num_pages: int, prefix_cache: PrefixCache | None = None):
        self.num_pages = num_pages
        self.prefix_cache = prefix_cache
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))  # never-cached pages; pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: plain free pages plus idle cached ones (evictable)."""
        return len(self._free) + (self.prefix_cache.num_idle if self.prefix_cache else 0)

    @property
    def num_plain_free(self) -> int:
        """Free pages that hold no cached prefix (taking one evicts nothing)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_in_use(self) -> int:
        """Pages at least one request holds."""
        return self.num_usable - self.num_free

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """n fresh page ids with one reference each, or None (and nothing taken) when fewer than n are free."""
        if not self.can_allocate(n):
            return None
        pages = []
        for _ in range(n):
            # Evict only when no never-cached page is left: a cached page may still save a prefill.
            page = self._free.pop() if self._free else self.prefix_cache.evict()
            self._refs[page] = 1
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Add a reference to pages a prefix-cache hit shares; an idle page stops being evictable."""
        for page in pages:
            if self._refs[page] == 0:
                self.prefix_cache.mark_busy(page)
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page. A page nobody holds goes back to the free list, or, if it
        holds a cached prefix, waits idle in the cache."""
        for page, count in collections.Counter(pages).items():
            if page == NULL_PAGE:
                raise ValueError("the null page is never allocated and cannot be freed")
            if self._refs[page] < count:
                raise ValueError(f"page {page} is freed more often than it was allocated")
        # Last page first: a sequence's tail is the least likely part to be shared, so it goes to the
        # front of the eviction order, and the plain free list hands out the first page first again.
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if self.prefix_cache is not None and self.prefix_cache.holds(page):
                self.prefix_cache.mark_idle(page)
            else:
                self._free.append(page)

    def evict_cached(self) -> int:
        """Drop every idle cached page back to the free list (reset the prefix cache); returns how many.
        Pages in use keep their cache entries."""
        count = 0
        while self.prefix_cache is not None and (page := self.prefix_cache.evict()) is not None:
            self._free.append(page)
            count += 1
        return count


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
