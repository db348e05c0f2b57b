"""Automatic prefix caching: full KV pages named by a hash chain of their tokens, reused across requests.

1. `page_key(parent, tokens, extra_keys)` is SHA-256 over the previous page's key, this page's token ids
   and extra keys (a request's `cache_salt`; the hashes of the images whose placeholder tokens the page
   holds). Because the parent key is folded in, a key names the whole
   prefix up to the end of its page, not just the page: equal keys mean equal K/V, whatever the page's
   position. Extra keys enter at the first page and reach every later page through the chain, so two
   salts never produce a common key.
2. A request extends its list of keys as pages fill (`extend_page_keys`); tokens are append-only, so a
   key, once computed, stays valid — also after a preemption, which is how a recomputed request finds
   its own pages again.
3. `PrefixCache` maps key -> page only for pages that are full and written (the scheduler registers a
   page after the step that completed it), so a page being written is never handed to another request.
4. The allocator owns reference counts. A cached page whose last user lets go is not freed: it becomes
   *idle* and waits in least-recently-used order. `lookup` hands idle and busy pages alike to a new
   request; `evict` gives the allocator the least recently used idle page when no plain free page is left.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from typing import Callable, Sequence

PageKey = bytes  # 32-byte SHA-256 digest

# The parent of a sequence's first page: a constant, so the first page's key depends on its content only.
_ROOT = b"\x00" * 32


def page_key(parent: PageKey | None, token_ids: Sequence[int], extra_keys: Sequence = ()) -> PageKey:
    """Key of one full page: SHA-256(parent key, token ids, extra keys), every field length-prefixed
    so no two different inputs serialise to the same bytes."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    # JSON gives a canonical byte form for the str/int keys used (a salt today; adapter ids later).
    extra = json.dumps(list(extra_keys), separators=(",", ":")).encode() if extra_keys else b""
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    return h.digest()


def extend_page_keys(keys: list[PageKey], token_ids: Sequence[int], page_size: int, num_pages: int,
                     extra_keys: Sequence = (), page_extras: Callable[[int], tuple] | None = None) -> list[PageKey]:
    """Append keys to `keys` (in place) until it covers the first `num_pages` full pages of `token_ids`.

    Only full pages get keys: a partial page can still change, so it cannot be shared. `page_extras(i)`: keys
    of page i's own (the images whose placeholder tokens it holds, `scheduling/images.py`).
    """
    num_pages = min(num_pages, len(token_ids) // page_size)
    while len(keys) < num_pages:
        i = len(keys)
        parent = keys[-1] if keys else None
        extra = tuple(extra_keys) if i == 0 else ()
        if page_extras is not None:
            extra += page_extras(i)
        keys.append(page_key(parent, token_ids[i * page_size:(i + 1) * page_size], extra))
    return keys


class PrefixCache:
    """Key <-> page maps plus the LRU order of idle cached pages. Host-only; the allocator drives it."""

    def __init__(self):
        self._page_of: dict[PageKey, int] = {}
        self._key_of: dict[int, PageKey] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # no users; least recently used first

    @property
    def num_cached(self) -> int:
        """Pages that hold a registered prefix, busy or idle."""
        return len(self._key_of)

    @property
    def num_idle(self) -> int:
        """Cached pages no request uses: reusable by a hit, or evictable when pages run short."""
        return len(self._idle)

    def holds(self, page: int) -> bool:
        return page in self._key_of

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def lookup(self, keys: Sequence[PageKey]) -> list[int]:
        """Pages of the longest cached prefix of `keys` (stops at the first miss: a key names a whole
        prefix, so nothing after a miss can be used)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def register(self, page: int, key: PageKey) -> bool:
        """Record that `page` (full, written, in use) holds the prefix named `key`. Returns False when
        another page already holds it (two requests computed the same prefix at once): the first one
        stays the cached copy and this page is freed normally when its request lets go."""
        if key in self._page_of or page in self._key_of:
            return False
        self._page_of[key] = page
        self._key_of[page] = key
        return True

    def mark_idle(self, page: int) -> None:
        """The page's last user let go: it becomes the most recently used idle page."""
        self._idle[page] = None

    def mark_busy(self, page: int) -> None:
        """A hit gave the idle page a user again: it may not be evicted while in use."""
        del self._idle[page]

    def evict(self) -> int | None:
        """Forget the least recently used idle page and return it (now a plain free page), or None."""
        if not self._idle:
            return None
        page, _ = self._idle.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        return page
