"""Prompt-lookup drafting: the tokens that followed the latest earlier occurrence of the sequence's tail.

1. Per request the proposer keeps its tokens as bytes, 4 per token id (`_Tokens`), extended with the
   tokens it accepts; `prepare` appends them while the device runs a step (a new request's prompt, most
   of all), so `propose` on the critical path converts the last step's few tokens only.
2. `propose` takes the longest n whose tail occurred before: the sequence's last n tokens, searched for
   backwards in the bytes before its newest token (`bytearray.rfind`, a C loop), give their latest earlier
   occurrence, and the K tokens after it are the drafts. The shortest tail is searched first: where it never
   occurred no longer one did, and most steps find nothing. A copy that reaches the end of the sequence goes on with the tokens it
   has just copied (a loop continues as a loop).
A search in C over the whole sequence costs about what one dict lookup does in Python up to a few thousand
tokens, and nothing per token as they arrive: an index of every n-gram (a tuple and a dict entry per token
and size) was the proposer's main host cost, paid on every token of every request, drafting or not.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from jaxserve.scheduling.request import Request

TOKEN_BYTES = array("i").itemsize  # token ids as C ints: 4 bytes on every platform JAX runs on


class _Tokens:
    """A request's known tokens as bytes, for searching."""
    __slots__ = ("data",)

    def __init__(self):
        self.data = bytearray()

    def extend(self, tokens: list[int]) -> None:
        known = len(self.data) // TOKEN_BYTES
        if len(tokens) > known:
            self.data += array("i", tokens[known:]).tobytes()

    def latest_before(self, pattern: bytes, end: int) -> int:
        """The token position of the latest occurrence of `pattern` that ends by token `end`, or -1.
        A byte match that does not start on a token's first byte is skipped."""
        stop = end * TOKEN_BYTES
        while True:
            found = self.data.rfind(pattern, 0, stop)
            if found < 0 or found % TOKEN_BYTES == 0:
                return found // TOKEN_BYTES if found >= 0 else -1
            stop = found + len(pattern) - 1  # earlier occurrences only


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.sizes = range(prompt_lookup_min, prompt_lookup_max + 1)
        self._tokens: dict[int, _Tokens] = {}

    def _known(self, request: Request) -> _Tokens:
        known = self._tokens.get(request.key)
        if known is None:
            known = self._tokens[request.key] = _Tokens()
        known.extend(request.token_ids)
        return known

    def observe(self, launched, draft: bool) -> None:
        pass  # drafts come from the host's tokens alone

    def prepare(self, requests: Sequence[Request]) -> None:
        for request in requests:
            self._known(request)

    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        return [self.lookup(request.token_ids, self._known(request)) for request in requests]

    def expects_drafts(self, request: Request) -> bool:
        return bool(self.lookup(request.token_ids, self._known(request)))

    def lookup(self, tokens: list[int], known: _Tokens) -> list[int]:
        last = len(tokens) - 1  # an occurrence must have a token after it: it ends before the newest

        def latest(n: int) -> int:
            return known.latest_before(known.data[(len(tokens) - n) * TOKEN_BYTES:], last)

        shortest = self.sizes[0]
        if shortest > last or (start := latest(shortest)) < 0:
            return []  # no longer tail occurs either: one search where most steps find nothing
        for n in reversed(self.sizes[1:]):
            if n <= last and (longer := latest(n)) >= 0:
                return _copy_from(tokens, longer + n, self.num_speculative_tokens)
        return _copy_from(tokens, start + shortest, self.num_speculative_tokens)

    def forget(self, keys: Sequence[int]) -> None:
        for key in keys:
            self._tokens.pop(key, None)


def _copy_from(tokens: list[int], start: int, count: int) -> list[int]:
    """`count` tokens from position `start` on, the copy overlapping its own output past the end (LZ77's
    rule): after "a b a b", a match at 2 continues "a b a b ..."."""
    period = len(tokens) - start
    out = tokens[start:start + count]
    while len(out) < count:
        out.append(out[len(out) - period])
    return out
