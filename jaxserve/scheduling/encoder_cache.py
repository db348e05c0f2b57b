"""The encoder cache: each image's encoder rows, computed once and kept by the image's content hash.

1. A request that carries images takes a reference on each image's hash when the scheduler gets it
   (`acquire`); the entry exists from then on, holding the image's pixels until it is encoded.
2. Before a step that places an image's rows is launched, the runner encodes the images of the step whose
   rows are missing (`missing`, `pixels`), in one call of the vision encoder's program, and stores them
   (`store`; the pixels are dropped then).
   Two requests with the same image share one entry: the image is encoded once.
3. When the request finishes (or is aborted) it lets go of its references (`release`). An entry nobody
   references stays, least recently used first, while the cache holds at most `max_bytes` of rows: a
   repeated image then skips the encoder. Past the limit, idle entries are evicted; entries still referenced
   never are (their requests need the rows for any recomputation after a preemption).
Host only (numpy rows, no device arrays): what a step places is gathered from here (`execution/image_rows.py`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Iterable

import numpy as np


@dataclasses.dataclass(eq=False)
class _Entry:
    rows: np.ndarray | None = None  # [image tokens, hidden] the encoder's output; None until encoded
    pixels: object = None  # the encoder's input, until encoded
    users: set[int] = dataclasses.field(default_factory=set)  # request keys that reference it


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[str, _Entry] = {}
        self._idle: OrderedDict[str, None] = OrderedDict()  # encoded entries nobody references; LRU first
        self.encoded = 0  # images the encoder ran for (a hit costs nothing)
        self.hits = 0  # references taken on an image already encoded

    # ---- queries ------------------------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_referenced(self) -> int:
        """Entries some live request still references."""
        return sum(bool(e.users) for e in self._entries.values())

    @property
    def num_bytes(self) -> int:
        return sum(e.rows.nbytes for e in self._entries.values() if e.rows is not None)

    def rows(self, content_hash: str) -> np.ndarray:
        """An encoded image's rows (KeyError for an image no request referenced, or one not encoded yet)."""
        rows = self._entries[content_hash].rows
        if rows is None:
            raise KeyError(f"image {content_hash[:12]} is not encoded yet")
        return rows

    def pixels(self, content_hash: str):
        return self._entries[content_hash].pixels

    def missing(self, hashes: Iterable[str]) -> list[str]:
        """Of `hashes` (all referenced), the distinct ones not encoded yet, in order."""
        return [h for h in dict.fromkeys(hashes) if self._entries[h].rows is None]

    # ---- references ---------------------------------------------------------------------------------

    def acquire(self, key: int, images: Iterable) -> None:
        """Request `key` needs these images' rows until it finishes (`images`: `scheduling.images.ImageSpan`s,
        their content hash and pixels)."""
        for image in images:
            h = image.content_hash
            entry = self._entries.get(h)
            if entry is None:
                entry = self._entries[h] = _Entry(pixels=image.pixels)
            elif entry.rows is not None and not entry.users:
                self.hits += 1
                del self._idle[h]
            elif entry.rows is not None:
                self.hits += 1
            entry.users.add(key)

    def release(self, key: int, hashes: Iterable[str]) -> None:
        """Request `key` is done with these images: an entry nobody needs becomes idle (kept while the byte
        limit allows; one never encoded is dropped)."""
        for h in dict.fromkeys(hashes):
            entry = self._entries.get(h)
            if entry is None or key not in entry.users:
                continue
            entry.users.discard(key)
            if not entry.users:
                if entry.rows is None:
                    del self._entries[h]
                else:
                    self._idle[h] = None
        self._evict_to(self.max_bytes)

    def store(self, content_hash: str, rows: np.ndarray) -> None:
        """The encoder's output for a referenced image."""
        entry = self._entries[content_hash]
        entry.rows, entry.pixels = rows, None
        self.encoded += 1
        self._evict_to(self.max_bytes)

    def clear_idle(self) -> int:
        """Drop every entry nobody references; returns how many."""
        before = len(self._idle)
        self._evict_to(0)
        return before

    def _evict_to(self, limit: int) -> None:
        held = self.num_bytes
        while self._idle and held > limit:
            h, _ = self._idle.popitem(last=False)
            held -= self._entries.pop(h).rows.nbytes
