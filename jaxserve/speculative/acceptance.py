"""How many of a sequence's drafts are expected to stand: the gain side of drafting's payoff (`payoff.py`).

1. After each verification the speculator reports, per request, how many drafts it verified and how many
   stood. Draft position i's rate is the chance that draft i stands once drafts 1..i-1 have, stood / tried,
   kept as decayed counts: per request over about its last ten verifications (`REQUEST_MEMORY`), and
   engine-wide over about the last hundred (`ENGINE_MEMORY`).
2. A request's rate at a position is its own counts with the engine-wide rate there added as
   `PRIOR_WEIGHT` verifications: a new request starts at what the engine has seen, and a few unlucky
   verifications cannot sink a request whose drafts do stand. The engine-wide rate at a position is
   likewise its counts with the rate of the position before (the first: `INITIAL_RATE`) as the prior:
   deep positions are verified less often, and before they are, they are taken to do as the one before.
3. The expected gain of a request's i-th draft is the chance that drafts 1..i all stand, the product of the
   first i rates: non-increasing in i, so the best drafts of a step are always a prefix of each sequence's.
   Verifying K drafts is expected to add the sum of the first K gains to the step's tokens.
4. Before the host knows a sequence's newest token, a proposer can only guess that it will draft (prompt
   lookup on the tokens known); `hit` is how often such a guess then drafted, kept in the same way.
5. A request that verifies nothing (its drafts stopped paying) keeps its counts, so its figures would never
   change: once it has verified nothing for `RETRY_STEPS` steps, its counts are dropped and it starts again
   from the engine-wide figures (its text may have come back to something the proposer finds).
"""

from __future__ import annotations

REQUEST_MEMORY = 0.9  # weight of a request's past per new verification of its drafts
ENGINE_MEMORY = 0.99  # the same for the engine-wide counts
PRIOR_WEIGHT = 4.0  # verifications' worth of the prior in each rate
# The engine's starting point, before any verification: hopeful enough that the first steps where the cost
# model says drafting would pay at these rates do draft (and measure), low enough that a slow verify step
# does not (`payoff.py` decides with the costs).
INITIAL_RATE = 0.6
INITIAL_HIT = 0.8
RETRY_STEPS = 32


class _Counts:
    """Decayed counts of drafts tried and stood per position, and of guesses made and hit."""
    __slots__ = ("tried", "stood", "guesses", "hits", "at")

    def __init__(self, k: int, at: int = 0):
        self.tried, self.stood = [0.0] * k, [0.0] * k
        self.guesses = self.hits = 0.0
        self.at = at  # the step of its last verification (or of its start)

    def verified(self, drafted: int, stood: int, memory: float) -> None:
        """Positions 1..stood stood; position stood + 1 (when drafted) did not; later ones were not reached."""
        tried, kept = self.tried, self.stood
        for i in range(len(tried)):
            tried[i] *= memory
            kept[i] *= memory
        for i in range(min(drafted, stood + 1, len(tried))):
            tried[i] += 1
            kept[i] += i < stood

    def guessed(self, hit: bool, memory: float) -> None:
        self.guesses = self.guesses * memory + 1
        self.hits = self.hits * memory + hit


def _rate(stood: float, tried: float, prior: float) -> float:
    return (stood + PRIOR_WEIGHT * prior) / (tried + PRIOR_WEIGHT)


class Acceptance:
    """Per request (by `Request.key`) and engine-wide acceptance per draft position, for K positions."""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self.engine = _Counts(self.k)
        self._requests: dict[int, _Counts] = {}
        self.steps = 0  # the speculator's step count (`step()`)
        self._engine_rates: list[float] | None = None  # cached until the engine's counts change

    def step(self) -> None:
        self.steps += 1

    def _of(self, key: int) -> _Counts:
        counts = self._requests.get(key)
        if counts is None or self.steps - counts.at > RETRY_STEPS:
            counts = self._requests[key] = _Counts(self.k, self.steps)
        return counts

    def engine_rates(self) -> list[float]:
        """The engine-wide rate at each position (each deeper one's prior: the one before)."""
        if self._engine_rates is None:
            rates, prior = [], INITIAL_RATE
            for stood, tried in zip(self.engine.stood, self.engine.tried):
                prior = _rate(stood, tried, prior)
                rates.append(prior)
            self._engine_rates = rates
        return self._engine_rates

    def gains(self, key: int) -> list[float]:
        """The expected gain of each of the request's K draft positions (non-increasing)."""
        counts, gains, p = self._of(key), [], 1.0
        for stood, tried, prior in zip(counts.stood, counts.tried, self.engine_rates()):
            p *= _rate(stood, tried, prior)
            gains.append(p)
        return gains

    def hit(self, key: int) -> float:
        """How often a guess that the request would draft came true."""
        engine = _rate(self.engine.hits, self.engine.guesses, INITIAL_HIT)
        counts = self._of(key)
        return _rate(counts.hits, counts.guesses, engine)

    def verified(self, key: int, drafted: int, stood: int) -> None:
        counts = self._of(key)
        counts.verified(drafted, stood, REQUEST_MEMORY)
        counts.at = self.steps
        self.engine.verified(drafted, stood, ENGINE_MEMORY)
        self._engine_rates = None

    def guessed(self, key: int, hit: bool) -> None:
        self._of(key).guessed(hit, REQUEST_MEMORY)
        self.engine.guessed(hit, ENGINE_MEMORY)

    def forget(self, key: int) -> None:
        self._requests.pop(key, None)
