"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the sequence's tail.

1. Per request an index maps every n-gram of its tokens (n from prompt_lookup_min to prompt_lookup_max)
   that has a token after it to the position after its latest occurrence. It grows with the tokens the
   request accepts; `prepare` indexes them while the device runs a step (a new request's prompt, most of
   all), so `propose` on the critical path looks at the last step's few tokens only.
2. `propose` tries the longest n first: the sequence's last n tokens, looked up, give the position their
   earlier occurrence continued at, and the K tokens from there are the drafts. A copy that reaches the
   end of the sequence goes on with the tokens it has just copied (a loop continues as a loop).
"""

from __future__ import annotations

from typing import Sequence

from jaxserve.scheduling.request import Request


class _Index:
    __slots__ = ("after", "indexed")

    def __init__(self, sizes: range):
        self.after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the index

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that end at positions indexed .. len - 2 (each has a token after it)."""
        end = len(tokens) - 1
        for n, table in self.after.items():
            for stop in range(max(self.indexed, n - 1), end):
                table[tuple(tokens[stop - n + 1:stop + 1])] = stop + 1
        self.indexed = max(self.indexed, end)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._indexes: dict[int, _Index] = {}

    def _index(self, request: Request) -> _Index:
        index = self._indexes.get(request.key)
        if index is None:
            index = self._indexes[request.key] = _Index(self.sizes)
        index.extend(request.token_ids)
        return index

    def observe(self, launched, draft: bool) -> None:
        pass  # drafts come from the host's tokens alone

    def prepare(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self._index(request)

    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        return [self.lookup(request.token_ids, self._index(request)) for request in requests]

    def expects_drafts(self, request: Request) -> bool:
        index = self._indexes.get(request.key)
        return index is not None and bool(self.lookup(request.token_ids, index))

    def lookup(self, tokens: list[int], index: _Index) -> list[int]:
        for n in reversed(self.sizes):
            if n > len(tokens):
                continue
            start = index.after[n].get(tuple(tokens[-n:]))
            if start is not None:
                return _copy_from(tokens, start, self.num_speculative_tokens)
        return []

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._indexes.pop(key, None)


def _copy_from(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens from position `start` on, the copy overlapping its own output past the end (LZ77's
    rule): after "a b a b", a match at 2 continues "a b a b ..."."""
    period = len(tokens) - start
    out = tokens[start:start + count]
    while len(out) < count:
        out.append(out[len(out) - period])
    return out
