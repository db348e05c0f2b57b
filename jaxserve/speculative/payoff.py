"""Whether a step drafts, and how many drafts each sequence verifies: expected tokens against measured cost.

Speculation trades the engine's one-step-ahead overlap (the host plans the next step while the device runs
this one) and the verify rows' compute for the drafts that stand. Whether that pays depends on the model,
the machine, the width of the batch and each request's text, so it is priced every step:
1. The speculator hands over the sequences that may draft, each with the expected gain of each of its
   draft positions (`acceptance.py`; times the chance that a guessed drafter drafts, while the newest
   tokens are not known yet), and the cost model (`cost.py`) prices a plain step and a drafting step with
   n drafts at the width served.
2. The drafts are ranked across sequences by gain. Verifying the n best gives (w + their gains) tokens in
   drafting_seconds(n) against w tokens in plain_seconds; the n with the best rate is chosen (0 allowed;
   a verify step's program draws every row its token bucket holds, so more drafts within a bucket cost
   the device nothing and each bucket's fullest n is a candidate, of drafts at least `MIN_GAIN` likely to
   stand), and drafting goes ahead only where that rate beats plain steps' by `MARGIN`. A sequence
   verifies its share of the n best, a prefix of its drafts: K per sequence, from its own acceptance.
3. Once the step in flight has been read (newest tokens known, drafts found), the choice is made again
   with the drafts found. Reading first is paid for by then, except that a step verifying drafts makes the
   next one read first too, which is charged unless drafting was the plan anyway. The drafts must still
   beat plain steps' rate (`advantage`), not the read-first step's own: a step after a verifying one reads
   first whatever it does, and measured against its own low rate drafting kept itself going step after step.
4. Probes: where drafting does not pay by the estimates, it is tried now and then, so that estimates gone
   stale (acceptance rising, a verify step that got cheaper) can bring it back. A probe verifies every
   draft found. It is taken only when a budget allows: the budget grows by `PROBE_SHARE` of every second
   served and pays each probe's predicted extra time (its step and the read-first step after it, or the
   ledger's surcharge where that is more; no credit for the tokens it gains, and at least a plain step's
   time), holding at most one probe's worth.
   So probes cost at most PROBE_SHARE of the serving time, and come about every 1 / PROBE_SHARE
   probe-lengths of it.
5. The guard (`ledger.py`): every step that drafts is booked as charged (what its decision expected) and
   as realized (the drafts that stood, the periods it took); at a width where drafting lost, the expected
   gains are discounted by the share of the charged tokens that stood, and drafting is priced at the extra
   seconds it realized beyond those charged, so predictions biased the same way every time stop costing
   throughput.
6. The speculator counts each step's outcome (`OUTCOMES`): drafting, probe, or off and why.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from jaxserve.speculative.cost import DraftingCost
from jaxserve.speculative.ledger import Ledger

MARGIN = 0.05  # drafting must be estimated this much faster than plain steps
# A draft less likely than this to stand is not verified, even where its row costs the device nothing (its
# token bucket's program runs anyway): the host still plans, sends and reads it back.
MIN_GAIN = 0.1
# Of the serving time, at most, spent on probes' extra time (issue 54 allows 2%): with the decisions' share
# (`speculator.GUESS_SHARE`) and a dormant step's own host work, what an engine that does not draft pays.
# Served, stories260K at 4 streams: a probe realizes 3-4 ms over a plain step of 1.2 ms, and at 0.5% they
# took about 0.7% of the time where drafting never paid.
PROBE_SHARE = 0.0025
OUTCOMES = {
    "drafting": "drafts verified: estimated to pay",
    "probe": "drafts verified to measure again, where the estimates say they do not pay",
    "unprofitable": "off: the drafts found or expected would not pay for the verify step and its reading first",
    "no_drafts": "off: no sequence may draft, or none is expected to find drafts",
    "measuring": "off: plain steps at this width are being measured (first, or again after a long while)",
    "batch_size": "off: disable_by_batch_size running sequences or more",
}


@dataclasses.dataclass(frozen=True)
class Decision:
    drafting: bool  # read the step in flight first, then draft (a probe included)
    outcome: str  # a key of OUTCOMES
    gain: float = 0.0  # expected tokens the drafts add to the step, as predicted (before the ledger's discount)
    seconds: float = 0.0  # the step's estimated extra time over a plain one (before the ledger's surcharge)


OFF = {reason: Decision(False, reason) for reason in ("unprofitable", "no_drafts", "measuring", "batch_size")}


def best_drafts(gains: Sequence[Sequence[float]], running: int, cost: DraftingCost, baseline: float,
                extra: float, plain_rate: float | None = None) -> tuple[list[int], float, float]:
    """The drafts to verify per sequence (`gains[s]`: sequence s's, non-increasing) that give the most
    tokens against the step without drafts, `running` sequences making one token each; `baseline`: seconds
    of the step without drafts; `extra`: seconds any drafting adds beyond its step; `plain_rate`: tokens per
    second of the steps after the baseline (default: the baseline's own rate). Drafting is weighed over the
    drafting step's time: its tokens against the baseline's and what plain steps make in the rest of that
    time (`advantage`). Returns (drafts per sequence, their summed gain, the drafting step's seconds), all
    zero where no n beats the baseline."""
    ranked = sorted(((g, s) for s, row in enumerate(gains) for g in row if g >= MIN_GAIN), reverse=True)
    if not ranked:
        return [0] * len(gains), 0.0, 0.0
    plain_rate = running / baseline if plain_rate is None else plain_rate
    total = list(itertools.accumulate(g for g, _ in ranked))
    best_n, best, best_seconds = 0, 1.0, 0.0
    buckets = cost.step_cost.buckets
    for n in sorted({min(b - running, len(ranked)) for b in buckets if b > running} | {len(ranked)}):
        if n <= 0:
            continue
        seconds = cost.drafting_seconds(running, n) + extra
        ratio = advantage(running, total[n - 1], seconds, baseline, plain_rate)
        if ratio > best:
            best_n, best, best_seconds = n, ratio, seconds
        if n == len(ranked):
            break
    counts = [0] * len(gains)
    for _, s in ranked[:best_n]:
        counts[s] += 1
    return counts, total[best_n - 1] if best_n else 0.0, best_seconds


def advantage(running: int, gain: float, seconds: float, baseline: float, plain_rate: float) -> float:
    """Tokens of a drafting step of `seconds` over those of the alternative in the same time: the step
    without drafts (`baseline` seconds, `running` tokens), then plain steps at `plain_rate`. Where the
    baseline is itself a plain step this is the ratio of the two steps' rates; where it is a step that reads
    first anyway, the plain steps after it set the bar (on a scripted host-bound machine, drafts standing 7
    times in 10 ran on every step at 0.90x speculation off against the read-first step's own rate)."""
    return (running + gain) / (running + max(seconds - baseline, 0.0) * plain_rate)


class DraftingPayoff:
    def __init__(self, cost: DraftingCost, probe_share: float = PROBE_SHARE, margin: float = MARGIN):
        self.cost = cost
        self.probe_share = probe_share
        self.margin = margin
        self.ledger = Ledger()
        self.budget = 0.0  # seconds probes may still spend
        self.probe_seconds = 0.0  # predicted extra seconds spent on probes, for the log and tests
        self.served_seconds = 0.0

    def served(self, seconds: float, booked_at: int = 0) -> None:
        """An engine-loop period with sequences running: the probe budget grows with it. `booked_at`: where
        it is a drafting step's (the step's own, or the next one, which waits for it), the width of that
        step; what the period took over a plain step's predicted time is booked as drafting's."""
        self.served_seconds += seconds
        self.budget += self.probe_share * seconds
        if booked_at and self.cost.measured(booked_at):
            self.ledger.spent(booked_at, seconds - self.cost.plain_seconds(booked_at))

    def stood(self, running: int, tokens: int) -> None:
        """Of the drafts a drafting step verified for a sequence, `tokens` stood."""
        self.ledger.stood(running, tokens)

    def summary(self, running: int) -> str:
        """The ledger at this width, for the log."""
        if not self.cost.measured(running):
            return "no drafting steps booked"
        return self.ledger.summary(running, running / self.cost.plain_seconds(running))

    def before_reading(self, running: int, expected: Sequence[Sequence[float]]) -> Decision:
        """Whether to read the step in flight and draft: `expected[s]`, the expected gain of each draft
        position of sequence s, a guessed drafter (its newest token not known yet)."""
        if not expected:
            return OFF["no_drafts"]
        if not self.cost.measured(running):
            return OFF["measuring"]
        plain = self.cost.plain_seconds(running)
        discount, surcharge = self._corrections(running, running / plain)
        _, gain, seconds = best_drafts(_discounted(expected, discount), running, self.cost, plain, surcharge)
        if gain and (running + gain) / seconds >= (1 + self.margin) * running / plain:
            if self.cost.stale(running):  # a few plain steps first: what drafting is weighed against
                return OFF["measuring"]
            return Decision(True, "drafting", gain / discount, seconds - surcharge - plain)
        # A probe: every draft verified, then a read-first step after it (or what drafting steps realized
        # beyond their charge, where the ledger knows more); charged at least a plain step, whatever the
        # estimates say (they may be what is wrong).
        drafts = sum(len(row) for row in expected)
        excess = max(self.cost.drafting_seconds(running, drafts) - plain
                     + max(self.cost.read_first_extra(running), surcharge), plain)
        self.budget = min(self.budget, excess)  # at most one probe's worth saved up
        if excess <= self.budget:
            self.budget -= excess
            self.probe_seconds += excess
            return Decision(True, "probe", 0.0, excess)
        return OFF["unprofitable"]

    def after_reading(self, running: int, gains: Sequence[Sequence[float]], planned: Decision) -> list[int]:
        """Drafts per sequence to verify, the newest tokens known: `gains[s]` for the drafts sequence s
        found; `planned`, what `before_reading` decided (a probe verifies every draft; a step that was not
        to draft pays for the read-first step its drafts would cause). A step planned to draft, and one
        that drafts without the plan, is booked in the ledger as charged."""
        if planned.outcome == "probe":
            drafts = sum(len(row) for row in gains)
            self.ledger.charged(running, sum(map(sum, gains)),
                                self.cost.drafting_seconds(running, drafts) - self.cost.plain_seconds(running))
            return [len(row) for row in gains]
        if planned.outcome == "drafting":
            self.ledger.charged(running, planned.gain, planned.seconds)
        if planned.outcome == "measuring" or not self.cost.measured(running):
            return [0] * len(gains)  # plain steps, until they are measured
        baseline = self.cost.drafting_seconds(running, 0)
        plain_rate = running / self.cost.plain_seconds(running)
        discount, surcharge = self._corrections(running, plain_rate)
        extra = surcharge + (0.0 if planned.drafting else self.cost.read_first_extra(running))
        counts, gain, seconds = best_drafts(_discounted(gains, discount), running, self.cost, baseline, extra,
                                            plain_rate)
        if gain and advantage(running, gain, seconds, baseline, plain_rate) >= 1 + self.margin:
            if not planned.drafting:
                self.ledger.charged(running, gain / discount, seconds - surcharge - baseline)
            return counts
        return [0] * len(gains)

    def _corrections(self, running: int, plain_rate: float) -> tuple[float, float]:
        """The ledger's discount of the gains and surcharge on the seconds at this width (1 and 0 where
        drafting paid). The ledger is charged what the decision predicted without them: booked with them,
        a surcharge would shrink the very gap it measures."""
        return self.ledger.discount(running, plain_rate), self.ledger.surcharge(running, plain_rate)


def _discounted(gains: Sequence[Sequence[float]], discount: float) -> Sequence[Sequence[float]]:
    return gains if discount == 1.0 else [[g * discount for g in row] for row in gains]
