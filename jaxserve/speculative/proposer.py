"""The interface every proposer implements, and what it is told about the requests it drafts for.

A proposer answers one question per step: given each sequence's known tokens, which tokens are likely to
come next (at most `num_speculative_tokens`)? It may keep per-request state (an n-gram index, a draft
model's KV pages) keyed by `Request.key`; the speculator tells it when a request is gone.

A proposer that drafts on the device sets `decides_early` (the speculator decides in `observe` whether the
next step drafts, since the drafting program runs right behind the step before) and offers
`program_seconds(bucket, drafting)`, its program's device time in a step of that token bucket, which the
drafting payoff counts in a step's cost (`cost.py`).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from jaxserve.scheduling.request import Request


class Proposer(Protocol):
    num_speculative_tokens: int

    def prepare(self, requests: Sequence[Request]) -> None:
        """Off the critical path (while the device runs a step): catch up on the requests' known tokens, so
        that `propose` has only the newest few left to look at."""

    def observe(self, launched, draft: bool) -> None:
        """A target step was just dispatched (a `LaunchedStep`: its plan, device inputs and results, still
        on the device). A device-side proposer dispatches its own work here, right behind it; `draft`:
        whether the next step is to draft (else it only keeps up with the target's tokens)."""

    def expects_drafts(self, request: Request) -> bool:
        """A cheap guess, from the known tokens, whether `propose` would draft for the request next step
        (the engine gives up its one-step-ahead pipeline only when some sequence is expected to draft)."""

    def propose(self, requests: Sequence[Request]) -> list[list[int]]:
        """Drafts for each request (possibly none), continuing its known tokens `token_ids`."""

    def forget(self, keys: Sequence[int]) -> None:
        """These requests finished or were aborted: drop what is kept for them."""
