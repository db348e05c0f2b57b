"""The engine's side of speculative decoding: who drafts this step, how many drafts each, and what it cost.

1. `wants_draws_first()`: drafting needs a sequence's newest token on the host, so the engine reads the
   step in flight before planning the next when this step is to draft. With `adaptive_drafting` (the
   default) that is decided by price (`payoff.py`): the expected gain of the sequences expected to draft
   (`acceptance.py`) against what a drafting step costs over a plain one at this width (`cost.py`), with
   rare probes where it does not pay. A proposer that drafts on the device (a draft model) is decided for
   one step ahead, in `observe`: its drafting program must run right behind the step before.
2. `propose()` (on the critical path, timed) asks the proposer for the sequences whose newest token is
   known, and chooses how many of each one's drafts to verify (K per sequence, 0 allowed); it leaves them
   on `Request.draft_token_ids` for the scheduler. It also reads back, from the tokens that arrived, how
   many drafts stood for each sequence that verified some: the acceptance per position.
3. `prepare()` runs while the device computes a step: the proposer catches up on new tokens and guesses
   which sequences will draft next time.
4. `after_step()` ends each engine step: `prepare`, then `record_step`, which times the loop's period for
   the cost model and counts the step's outcome (drafting, probe, or off and why) for the log and /metrics.
5. Standing by: while drafting is off and the next decision is not due (`standing_by`, set by
   `wants_draws_first`), a step that does not read first skips `propose`, `observe` and `prepare`, and
   `after_step` counts it, and times and prices one period in STANDBY_SAMPLE_PERIODS. Such steps are most
   of an engine's where drafting does not pay, and their host work is all that speculation costs it
   there: on stories260K at 4 streams on CPU (a 1.5-2 ms step) the calls of a step took about 10 us in a
   loop and 100 us in the server, where they share the GIL with the HTTP thread and the cores with XLA's,
   and the server served 0.93x one without speculation (0.98x with the speculator attached but never
   called). Standing by, it served 1.01x; on a faster machine (a 1.1-1.3 ms step), 0.96x, and 0.98x once
   the periods between samples went untimed.
A sequence may speculate only where verification draws exactly what a plain step would: no grammar
(its masks follow each token), no presence, frequency or repetition penalty (their counts follow each
token), and no `min_tokens` still suppressing EOS (its mask follows the count). Such a sequence proposes
nothing; its distribution is never changed.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Sequence

from jaxserve.config import SpeculativeConfig
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.step_cost import StepCostModel
from jaxserve.speculative.acceptance import Acceptance
from jaxserve.speculative.cost import Average, DraftingCost, width_class
from jaxserve.speculative.payoff import OFF, Decision, DraftingPayoff
from jaxserve.speculative.proposer import Proposer

logger = logging.getLogger(__name__)
LOG_INTERVAL_SECONDS = 10.0
# While drafting is off (adaptive), the decision is made again only every few steps, and the proposer's
# guesses of who would draft only for those steps: that host work is what an engine that does not draft
# pays over one without speculation, and on a small model the host's work per step is the step. The
# interval is priced: a decision's measured host time is at most GUESS_SHARE of the plain steps' time
# between decisions, within 1..MAX_RECHECK_STEPS. So on the 124.7M model on CPU (20+ ms steps) every step
# decides, and a request whose text starts to repeat drafts at its next step (at a fixed 8 steps a third of
# its drafting steps were lost, 1.29x against 1.56x when every draft found was verified); on stories260K
# (0.5-4 ms steps) 5 to 32 steps apart. (Backing the interval off while decisions kept finding drafting off
# was tried: new requests then waited up to 64 steps for their first guess.) At 1% and 16 steps, with probes
# at 1%, stories260K at 4 streams served 0.90x speculation off while drafting on 1% of its steps.
GUESS_SHARE = 0.005
MAX_RECHECK_STEPS = 32
PLANNING_SAMPLE_STEPS = 8  # the host's planning time of an overlapped step is sampled every this many steps
# While standing by, one period in this many is timed and priced into the cost model (`_stand_by`); between
# them the clock is not read.
STANDBY_SAMPLE_PERIODS = 4
DRAFT_ALL = Decision(True, "drafting")  # without adaptive drafting: every draft found is verified


def exact_per_position(request: Request) -> bool:
    """Whether verifying drafts after this request's tokens draws exactly as plain steps would."""
    p = request.params
    return (not request.constrained and p.presence_penalty == 0 and p.frequency_penalty == 0
            and p.repetition_penalty == 1 and request.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, step_cost: StepCostModel):
        self.config = config
        self.proposer = proposer
        self.num_speculative_tokens = config.num_speculative_tokens
        self.propose_seconds = 0.0  # host time on the critical path (proposing), for the log and metrics
        self.prepare_seconds = 0.0  # host time overlapped with the device (indexing, guessing)
        self.proposals = 0  # engine steps the speculator served (proposing or standing by)
        self.standing_by = False  # this step: drafting off, no decision due (the engine skips most calls)
        self.acceptance = Acceptance(config.num_speculative_tokens)
        # Steps that verify drafts, timed apart from plain ones (the engine feeds it: `step_timing.py`).
        self.verify_cost = StepCostModel(step_cost.buckets)
        self.cost = DraftingCost(step_cost, self.verify_cost, getattr(proposer, "program_seconds", None))
        self.payoff = DraftingPayoff(self.cost) if config.adaptive_drafting else None
        self.outcomes: collections.Counter = collections.Counter()  # OUTCOMES key -> engine steps
        self._decides_early = getattr(proposer, "decides_early", False)
        # Only adaptive drafting decides at intervals, and a draft model's program follows every step.
        self._may_stand_by = self.payoff is not None and not self._decides_early
        self._planned = OFF["no_drafts"]  # this step's decision (or, deciding early, the next step's)
        self._recheck_at = 0  # the proposal count from which the decision is made again while off
        self._guess_seconds = Average()  # host seconds of a decision: the proposer's guesses and the pricing
        self._prepared_seconds = 0.0  # the guesses' share of it, made by the last prepare()
        self._width = 0  # the width class of the batch when it was made
        self._hopeful: set[int] = set()  # requests whose known tokens gave a draft at the last prepare()
        self._known: set[int] = set()
        # key -> (known tokens when it drafted, drafts, the width of its step)
        self._verifying: dict[int, tuple[int, int, int]] = {}
        # The ledger's realized side (`ledger.py`), by the width of the drafting step booked (0: none): this
        # call's period, and the drafts verified by this call's step.
        self._period_booked_at = self._verified_booked_at = 0
        self._step_started = self._launched_at = 0.0
        # This call's step: (tokens, verifies drafts?, the proposer's program after it drafted?)
        self._launched: tuple[int, bool, bool] | None = None
        self._in_flight: tuple[int, bool, bool] | None = None  # the step the next call waits for
        self._period_start: float | None = None
        self._untimed = 0  # loop periods standing by since the last timed one (`_stand_by`)
        self._logged_at = time.monotonic()
        self._logged = (0, 0, 0, collections.Counter())

    # ---- deciding -----------------------------------------------------------------------------------

    def candidates(self, requests: Sequence[Request]) -> list[Request]:
        return [r for r in requests if r.is_decoding and not r.is_prefilling and r.num_tokens < r.max_len - 1
                and exact_per_position(r)]

    def _plan(self, running: Sequence[Request], hopeful: set[int] | None) -> Decision:
        """The decision for the next step: made again every step while it drafts, every few steps while it
        does not (`_recheck_interval`), and when the batch's width moves (`_width_moved`)."""
        width = width_class(len(running)) if running else 0
        if self._guessing or self._width_moved(width):
            start = time.perf_counter()
            self._planned = self._decide(running, hopeful)
            self._guess_seconds.add(self._prepared_seconds + time.perf_counter() - start, self.proposals)
            self._prepared_seconds = 0.0
            self._width = width
            self._recheck_at = self.proposals + self._recheck_interval(len(running))
        return self._planned

    def _width_moved(self, width: int) -> bool:
        """Whether the width class is more than one class from the one decided at. A full batch jitters
        by one class: a finished sequence leaves 15 of 16 running until the scheduler refills its slot, so
        on stories260K at 16 streams the width crossed 8|16 on two steps in five, and a decision there
        each time (the proposer's guesses for every sequence, 0.2-0.5 ms on a 3 ms step) cost more than
        drafting could save. Within one class the decision stands until its recheck."""
        decided = self._width
        return width > 2 * decided or 2 * width < decided

    def _recheck_interval(self, running: int) -> int:
        """Steps until the next decision while off: its host time at most GUESS_SHARE of theirs."""
        if self.payoff is None or not running or not self.cost.measured(running):
            return 1
        steps = self._guess_seconds.value / (GUESS_SHARE * self.cost.plain_seconds(running))
        return min(max(math.ceil(steps), 1), MAX_RECHECK_STEPS)

    @property
    def _guessing(self) -> bool:
        """Whether the next decision will be made, and needs the proposer's guesses of who will draft."""
        return self.payoff is None or self._planned.drafting or self.proposals >= self._recheck_at

    def _decide(self, running: Sequence[Request], hopeful: set[int] | None) -> Decision:
        """Whether the next step drafts: `hopeful`, the requests expected to draft (None: every candidate)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return OFF["batch_size"]
        expecting = [r for r in self.candidates(running) if hopeful is None or r.key in hopeful]
        if not expecting:
            return OFF["no_drafts"]
        if self.payoff is None:
            return DRAFT_ALL
        acceptance = self.acceptance
        expected = []
        for r in expecting:
            hit = acceptance.hit(r.key)
            expected.append([hit * g for g in acceptance.gains(r.key)])
        return self.payoff.before_reading(len(running), expected)

    def wants_draws_first(self, running: Sequence[Request]) -> bool:
        """Whether to read the step in flight before planning: this step is to draft. Also sets
        `standing_by`: drafting is off, nothing it drafted is waiting to be read, and the next decision is
        not due by the end of this step."""
        if (self.proposals + 1) % PLANNING_SAMPLE_STEPS == 0:  # the step `record_step` samples
            self._step_started = time.perf_counter()
        if not self._decides_early:
            self._plan(running, self._hopeful)
        drafting = self._planned.drafting
        self.standing_by = (self._may_stand_by and not drafting and bool(running)
                            and self.proposals + 1 < self._recheck_at and not self._verifying
                            and not self._verified_booked_at)
        return drafting

    def propose(self, running: Sequence[Request], read_first: bool) -> None:
        """Drafts for the sequences whose newest token is known, as many of each as pay. Their tokens are
        known when the engine read the step in flight first (`read_first`), for whatever reason, or had
        none in flight."""
        start = time.perf_counter()
        self.standing_by = False  # it proposes after all (the engine read first for its own reasons)
        if self._verifying:
            self._settle(running)
        planned = self._planned
        known = read_first or self._in_flight is None
        ready = ([r for r in self.candidates(running) if not r.num_pending]
                 if known and planned.outcome != "batch_size" else [])
        verified = found = False
        if ready:
            drafts = [d[:self.num_speculative_tokens] for d in self.proposer.propose(ready)]
            found = any(drafts)
            counts = self._counts(running, ready, drafts, planned)
            for request, found_drafts, count in zip(ready, drafts, counts):
                request.draft_token_ids = found_drafts[:count]
                if count:
                    verified = True
                    self._verifying[request.key] = (len(request.token_ids), count, len(running))
        # The periods of a drafting step (those `DraftingPayoff.after_reading` books as charged) are booked
        # as realized: its own, and the next one, which waits for it (and reads first).
        drafting_step = planned.drafting and bool(ready)  # a probe's too
        self._period_booked_at = len(running) if drafting_step else self._verified_booked_at
        self._verified_booked_at = len(running) if verified else 0
        if running:
            self.outcomes[self._outcome(planned, verified, found)] += 1
        self.proposals += 1
        self.acceptance.step()
        self.propose_seconds += time.perf_counter() - start

    def _counts(self, running, ready: list[Request], drafts: list[list[int]], planned: Decision) -> list[int]:
        if self.payoff is None:
            return [len(d) for d in drafts]
        if planned.drafting:  # how often a guess that a sequence would draft came true
            for request, found in zip(ready, drafts):
                if self._decides_early or request.key in self._hopeful:
                    self.acceptance.guessed(request.key, bool(found))
        gains = [self.acceptance.gains(r.key)[:len(d)] for r, d in zip(ready, drafts)]
        return self.payoff.after_reading(len(running), gains, planned)

    @staticmethod
    def _outcome(planned: Decision, verified: bool, found: bool) -> str:
        if verified:
            return "probe" if planned.outcome == "probe" else "drafting"
        if planned.drafting:
            return "unprofitable" if found else "no_drafts"
        return planned.outcome

    def _settle(self, running: Sequence[Request]) -> None:
        """How many drafts stood for each sequence whose verification the host has read since."""
        for request in running:
            verifying = self._verifying.get(request.key)
            if verifying is None or request.num_pending or len(request.token_ids) <= verifying[0]:
                continue
            del self._verifying[request.key]
            known, drafts, booked_at = verifying
            stood = min(len(request.token_ids) - known - 1, drafts)
            self.acceptance.verified(request.key, drafts, stood)
            if self.payoff is not None:
                self.payoff.stood(booked_at, stood)

    # ---- around the device step -----------------------------------------------------------------------

    def warmup(self) -> None:
        warmup = getattr(self.proposer, "warmup", None)
        if warmup is not None:
            warmup()

    def observe(self, launched, running: Sequence[Request]) -> None:
        """Right after a step is dispatched. A proposer drafting on the device decides here whether the
        next step drafts, since its drafting program runs now."""
        self._launched_at = launched.launched_at
        if self._decides_early:
            self._plan(running, None)
        self.proposer.observe(launched, self._planned.drafting)
        plan = launched.step
        self._launched = (plan.num_tokens, plan.verifies_drafts,
                          self._decides_early and self._planned.drafting)

    def prepare(self, running: Sequence[Request]) -> None:
        if not self._guessing:  # nothing to do until the next decision (what finished is forgotten then)
            return
        start = time.perf_counter()
        keys = {r.key for r in running}
        gone = self._known - keys
        if gone:
            self.proposer.forget(list(gone))
            for key in gone:
                self._verifying.pop(key, None)
                self.acceptance.forget(key)
        self._known = keys
        if not self._decides_early:
            candidates = self.candidates(running)
            self.proposer.prepare(candidates)
            self._hopeful = {r.key for r in candidates if self.proposer.expects_drafts(r)}
        seconds = time.perf_counter() - start
        self._prepared_seconds = seconds
        self.prepare_seconds += seconds

    def after_step(self, running: Sequence[Request], read_first: bool, launched, stats) -> None:
        """The end of each engine step, while the device runs the step just `launched` (None: none).
        Standing by, the step was neither proposed for nor observed: what those would have recorded of it
        is set here (no drafts, nothing booked)."""
        if self.standing_by:
            self._stand_by(running, launched, stats)
            return
        self.prepare(running)
        self.record_step(len(running), read_first)
        self.log_if_due(stats, running)

    def _stand_by(self, running: Sequence[Request], launched, stats) -> None:
        """A step standing by (it neither read first nor proposed): counted, and only one loop period in
        STANDBY_SAMPLE_PERIODS timed (the clock is read at the end of the step before it and of its own),
        which stands for those since the last timed one in the probes' budget. The rest only shift the
        step in flight and count themselves: on stories260K at 4 streams, the full bookkeeping on every
        such step (two clock reads, the cost model, the budget, the log's clock, about 10 us a step
        offline) made the server 3% slower than standing by without it, because on CPU it takes a core
        from the device step it overlaps."""
        self.proposals += 1
        self.acceptance.step()
        self.outcomes[self._planned.outcome] += 1
        self._period_booked_at = 0
        if launched is not None:
            self._launched_at = launched.launched_at
            self._launched = (launched.step.num_tokens, False, False)
        phase = self.proposals % STANDBY_SAMPLE_PERIODS
        if phase == 0:  # the sampled period
            self.record_step(len(running), False)
            self.log_if_due(stats, running)
            return
        self._in_flight, self._launched = self._launched, None
        self.cost.skip(False)
        self._untimed += 1
        # The sampled period starts at this step's end; a period not timed from its start is not timed.
        self._period_start = time.perf_counter() if phase == STANDBY_SAMPLE_PERIODS - 1 else None

    def record_step(self, running: int, read_first: bool) -> None:
        """After each engine step (`running`: the sequences it served; `read_first`: whether it read the
        step in flight before planning this one)."""
        now = time.perf_counter()
        reading, self._in_flight, self._launched = self._in_flight, self._launched, None
        if running == 0:
            self._period_start = None
            self._untimed = 0
            self.cost.idle()
            return
        sampled = self.proposals % PLANNING_SAMPLE_STEPS == 0
        if sampled and not read_first and self._in_flight is not None:
            self.cost.planned(self._launched_at - self._step_started, running)  # a sample now and then will do
        if self._period_start is not None and reading is not None:
            period = now - self._period_start
            self.cost.observe(period, read_first, running, *reading)
            if self.payoff is not None:  # a timed period stands for those before it that were not
                self.payoff.served(period * (1 + self._untimed), self._period_booked_at)
            self._untimed = 0
        elif reading is not None:  # the period after one standing by that was not timed from its start
            self._untimed += 1
        self._period_start = now

    # ---- reporting --------------------------------------------------------------------------------------

    def log_if_due(self, stats, running: Sequence[Request] = ()) -> None:
        """Every few seconds while steps run: vLLM's summary (acceptance, mean accepted length, per
        position), the proposer's host time per step, and how often drafting was on and why it was off
        (`stats`: the engine's `EngineStats`)."""
        now = time.monotonic()
        if now - self._logged_at < LOG_INTERVAL_SECONDS:
            return
        counts = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
        steps = self.outcomes - self._logged[3]
        if not steps:
            return
        drafts, drafted, accepted = (a - b for a, b in zip(counts, self._logged[:3]))
        self._logged_at, self._logged = now, (*counts, self.outcomes.copy())
        if drafts:
            per_position = [f"{a / stats.spec_drafts:.2f}" for a in stats.spec_accepted_per_pos]
            logger.info("speculative decoding: %d drafts, acceptance %.1f%%, mean accepted length %.2f; since "
                        "start: per position %s, proposer %.2f ms per step on the critical path (%.2f ms "
                        "overlapped)", drafts, 100 * accepted / max(drafted, 1), 1 + accepted / max(drafts, 1),
                        ", ".join(per_position), 1e3 * self.propose_seconds / max(self.proposals, 1),
                        1e3 * self.prepare_seconds / max(self.proposals, 1))
        total = sum(steps.values())
        shares = ", ".join(f"{100 * n / total:.0f}% {outcome.replace('_', ' ')}"
                           for outcome, n in steps.most_common())
        estimates = "idle"
        if running:
            estimates = self.cost.summary(len(running))
            if self.payoff is not None:
                estimates += f"; {self.payoff.summary(len(running))}"
        logger.info("speculative decoding: %d steps: %s; %s", total, shares, estimates)

