"""The engine's side of speculative decoding: who drafts this step, and the drafts left for the scheduler.

1. `wants_draws_first()`: drafting needs a sequence's newest token on the host, so when some sequence is
   expected to draft, the engine reads the step in flight before planning the next one (the asynchronous
   overlap is traded for several tokens per step). Above `disable_by_batch_size` running sequences, or
   when no sequence's known tokens would give a draft, the engine keeps its one-step-ahead pipeline.
2. `propose()` (on the critical path, timed) asks the proposer for every sequence that may speculate and
   leaves the drafts on `Request.draft_token_ids`; the scheduler plans them into the sequence's span.
3. `prepare()` runs while the device computes a step: the proposer catches up on new tokens and guesses
   which sequences will draft next time. A sequence whose drafts have lately stood less than
   `PAYOFF_TOKENS` per verification (random text under prompt lookup) is not waited for during the next
   `RETRY_STEPS` steps: reading the step in flight first idles the device for the host's planning, which
   only pays off when drafts stand.
4. `record_step()` after each step feeds `DraftingPayoff` (`payoff.py`; `adaptive_drafting`, on by default),
   which measures whether drafting makes this engine faster under the load it serves and pauses it, for
   everybody, while plain steps are.
A sequence may speculate only where verification draws exactly what a plain step would: no grammar
(its masks follow each token), no presence, frequency or repetition penalty (their counts follow each
token), and no `min_tokens` still suppressing EOS (its mask follows the count). Such a sequence proposes
nothing; its distribution is never changed.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

from jaxserve.config import SpeculativeConfig
from jaxserve.scheduling.request import Request
from jaxserve.speculative.payoff import DraftingPayoff
from jaxserve.speculative.proposer import Proposer

logger = logging.getLogger(__name__)
LOG_INTERVAL_SECONDS = 10.0
PAYOFF_TOKENS = 0.5  # accepted drafts per verification (moving average) below which a sequence is benched
RETRY_STEPS = 32  # steps a benched sequence is not waited for


def exact_per_position(request: Request) -> bool:
    """Whether verifying drafts after this request's tokens draws exactly as plain steps would."""
    p = request.params
    return (not request.constrained and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.repetition_penalty == 1 and request.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config = config
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens
        self.propose_seconds = 0.0  # host time on the critical path (proposing), for the log and metrics
        self.prepare_seconds = 0.0  # host time overlapped with the device (indexing, guessing)
        self.proposals = 0  # propose() calls
        self._hopeful: set[int] = set()  # requests whose known tokens gave a draft at the last prepare()
        self._known: set[int] = set()
        self._verifying: dict[int, tuple[int, int]] = {}  # key -> (known tokens when it drafted, drafts)
        self._payoff: dict[int, float] = {}  # key -> moving average of its accepted drafts per verification
        self._benched_until: dict[int, int] = {}  # key -> the proposal count when it may be waited for again
        self._logged_at = time.monotonic()
        self._logged_counts = (0, 0, 0)
        self.payoff = DraftingPayoff() if config.adaptive_drafting else None

    def enabled_for(self, running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return (limit is None or running < limit) and (self.payoff is None or self.payoff.allows_drafting())

    def record_step(self, stats, running: int) -> None:
        """After each engine step (`stats`: the engine's `EngineStats`; `running`: sequences it served)."""
        if self.payoff is not None:
            self.payoff.record_step(stats.generation_tokens, running)

    def candidates(self, requests: Sequence[Request]) -> list[Request]:
        if not self.enabled_for(len(requests)):
            return []
        return [r for r in requests if r.is_decoding and not r.is_prefilling and r.num_tokens < r.max_len - 1
                and exact_per_position(r)]

    def wants_draws_first(self, running: Sequence[Request]) -> bool:
        """Whether to read the step in flight before planning: some sequence is expected to draft."""
        return self.enabled_for(len(running)) and any(r.key in self._hopeful for r in running)

    def propose(self, running: Sequence[Request]) -> None:
        start = time.perf_counter()
        self._settle(running)
        ready = [r for r in self.candidates(running) if not r.num_pending]
        if ready:
            for request, drafts in zip(ready, self.proposer.propose(ready)):
                request.draft_token_ids = drafts[:self.num_speculative_tokens]
                if drafts:
                    self._verifying[request.key] = (len(request.token_ids), len(request.draft_token_ids))
        self.proposals += 1
        self.propose_seconds += time.perf_counter() - start

    def _settle(self, running: Sequence[Request]) -> None:
        """How many drafts stood for each sequence whose verification the host has read since."""
        for request in running:
            verifying = self._verifying.get(request.key)
            if verifying is None or request.num_pending or len(request.token_ids) <= verifying[0]:
                continue
            del self._verifying[request.key]
            accepted = min(len(request.token_ids) - verifying[0] - 1, verifying[1])
            payoff = (self._payoff.get(request.key, 1.0) + accepted) / 2
            if payoff < PAYOFF_TOKENS:
                self._benched_until[request.key] = self.proposals + RETRY_STEPS
                payoff = PAYOFF_TOKENS  # one more chance once it is back
            self._payoff[request.key] = payoff

    def log_if_due(self, stats) -> None:
        """Every few seconds while drafts are verified, vLLM's summary: acceptance, mean accepted length,
        per position, and the proposer's host time per step (`stats`: the engine's `EngineStats`)."""
        now = time.monotonic()
        counts = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
        if now - self._logged_at < LOG_INTERVAL_SECONDS or counts == self._logged_counts:
            return
        drafts, drafted, accepted = (a - b for a, b in zip(counts, self._logged_counts))
        self._logged_at, self._logged_counts = now, counts
        per_position = [f"{a / stats.spec_drafts:.2f}" for a in stats.spec_accepted_per_pos]
        logger.info("speculative decoding: %d drafts, acceptance %.1f%%, mean accepted length %.2f; since start: "
                    "per position %s, proposer %.2f ms per step on the critical path (%.2f ms overlapped)",
                    drafts, 100 * accepted / max(drafted, 1), 1 + accepted / max(drafts, 1),
                    ", ".join(per_position), 1e3 * self.propose_seconds / max(self.proposals, 1),
                    1e3 * self.prepare_seconds / max(self.proposals, 1))

    def warmup(self) -> None:
        warmup = getattr(self.proposer, "warmup", None)
        if warmup is not None:
            warmup()

    def observe(self, launched) -> None:
        self.proposer.observe(launched)

    def prepare(self, running: Sequence[Request]) -> None:
        start = time.perf_counter()
        keys = {r.key for r in running}
        gone = self._known - keys
        if gone:
            self.proposer.forget(list(gone))
            for key in gone:
                for kept in (self._verifying, self._payoff, self._benched_until):
                    kept.pop(key, None)
        self._known = keys
        candidates = self.candidates(running)
        self.proposer.prepare(candidates)
        self._hopeful = {r.key for r in candidates if self._benched_until.get(r.key, 0) <= self.proposals
                         and self.proposer.expects_drafts(r)}
        self.prepare_seconds += time.perf_counter() - start
