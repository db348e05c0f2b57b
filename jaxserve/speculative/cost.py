"""What a step costs with drafts and without, at the width of batch being served: the cost side of
drafting's payoff (`payoff.py`).

1. The engine loop's period (from the end of one `Engine.step` call to the end of the next) is the device
   time of the step that call waited for plus the host work the device did not overlap. The device part is
   predicted from step-time models (`scheduling/step_cost.py`: a time per token bucket, measured at warm-up
   and while serving), the scheduler's for plain steps and the speculator's own for steps verifying drafts
   (their program draws a row per draft: an LM head and a sampler row each), and, for a draft model, from
   its own program's time per bucket (timed at warm-up); what the prediction leaves, the residual, is learnt per
   kind of period and width (running sequences, in powers of two):
   - read first: the call read the step in flight before planning the next (drafting needs the newest
     tokens, and a step after one that verified drafts needs them too), so the device idled while the host
     planned;
   - overlapped: the call planned while the device ran, the engine's one-step-ahead pipeline.
   A period counts when the call before was of the same kind (one that switches kinds mixes both), into a
   running mean that turns into an exponential average (`MEMORY`) once it holds enough; a period far above
   its prediction (a pause) is clipped. The time the
   attention spends on the KV read is left in the residual: drafts add a few tokens to a context of
   hundreds, and the model's KV term, fitted across buckets, is too loose to price a difference with.
   Plain steps at a width are measured again every `REFRESH_PERIODS` (a few plain steps, while drafting
   pays), so their cost follows the machine.
   The device part is the bucket's idle step as timed at warm-up (the plain program and the verifying one,
   in the same minutes) where it was timed: the step-time models learnt online fit a KV term that can take
   a small bucket's whole time (the 124.7M model at one sequence on CPU: a plain step priced 0 ms on the
   device, its whole time left in the residual, against 34 ms for a verifying one), and a residual measured
   against one basis weighed against a device time from the other priced drafting at twice its cost. Idle
   times from one calibration share one basis; the residuals take the KV read and the machine's drift. A
   run without calibration (multi-host) prices from the online models. The idle times are taken as an
   envelope: a bucket's step costs at least any smaller bucket's, and a verifying step at least a plain one
   of its bucket. Each is one or two runs timed at warm-up, and on stories260K at 4 streams bucket 4's plain
   step timed 2.6 ms against 2.0 ms for bucket 8's verifying one, which priced four drafts below none.
2. Predictions: a plain step of w sequences, device(w tokens) + the overlapped residual; a drafting step
   with n drafts, device(w + n tokens) + the draft model's drafting program + the read-first residual. The
   read-first residual starts from a prior that counts as one period: the overlapped residual plus the
   host's own planning time of a step (what reading first puts in series with the device), measured on
   overlapped steps; so a single odd period cannot settle it.
"""

from __future__ import annotations

from typing import Callable

from jaxserve.scheduling.step_cost import StepCostModel

MEMORY = 0.9  # weight of the past per new period of the same kind and width (about the last ten count)
MIN_PERIODS = 3  # overlapped periods at a width before plain steps there count as measured
# Plain steps at a width are measured again once their last period is this many periods old: while drafting
# pays, every step reads first, and a plain step's cost learnt long ago (at another load) would go unchecked.
REFRESH_PERIODS = 1024
CLIP = 2.0  # a period more than this many times its prediction counts as if it took that long

# (bucket, drafting?) -> seconds of a proposer's own device program in a step of that bucket (a draft model
# follows every step and drafts only when asked); None for a proposer without one (prompt lookup).
ProgramSeconds = Callable[[int, bool], float] | None


def width_class(running: int) -> int:
    """The width costs are kept for: running sequences rounded down to a power of two."""
    return 1 << (running.bit_length() - 1)


class Average:
    """A running mean of the first periods (a prior, when given, counting as one), then an exponential
    average; measured again after REFRESH_PERIODS, it starts a running mean again from its old value."""
    __slots__ = ("value", "count", "weight", "at")

    def __init__(self, prior: float | None = None):
        self.value, self.count, self.weight = prior or 0.0, 0, 0 if prior is None else 1
        self.at = 0  # the period count at its last period

    def add(self, x: float, at: int) -> None:
        if self.count and at - self.at >= REFRESH_PERIODS:
            self.weight = 1  # measured again after a long while: the old value counts as one period
        self.weight += 1
        self.count += 1
        self.value += (x - self.value) * max(1 / self.weight, 1 - MEMORY)
        self.at = at


class DraftingCost:
    def __init__(self, step_cost: StepCostModel, verify_cost: StepCostModel | None = None,
                 program_seconds: ProgramSeconds = None):
        self.step_cost = step_cost  # plain steps' device time per bucket
        self.verify_cost = verify_cost  # steps verifying drafts (their program's draft rows run)
        self.program_seconds = program_seconds
        self._timed: dict[tuple[int, bool], float] = {}  # (bucket, verifies?) -> its idle step, timed at warm-up
        self._idle: dict[tuple[int, bool], float] = {}  # the same, as the envelope (`timed_idle`)
        self._residual: dict[tuple[bool, int], Average] = {}  # (read first?, width class) -> seconds
        self._planning: dict[int, Average] = {}  # width class -> host seconds from a step's start to launch
        self._last_kind: bool | None = None
        self.periods = 0  # periods seen

    @property
    def calibrated(self) -> bool:
        return self.step_cost.calibrated

    def timed_idle(self, bucket: int, verifies: bool, seconds: float) -> None:
        """The idle step of `bucket`'s program (`verifies`: the one verifying drafts) took `seconds`."""
        # The envelope from below: the scheduler's step-time model makes the same timings monotone from above
        # (a bucket no slower than a bigger one, `StepCostModel._refit`), which prices small steps low; here a
        # step priced low is drafting that loses, so each is priced at least as the cheaper ones measured.
        self._timed[bucket, verifies] = seconds
        self._idle = {(b, v): max(t for (c, w), t in self._timed.items() if c <= b and w <= v) for b, v in self._timed}

    def device_seconds(self, tokens: int, verifies: bool, drafting_program: bool) -> float:
        """A step of `tokens` tokens (its bucket's program), verifying drafts or not, and the proposer's
        program after it (drafting or only following), on the device."""
        bucket = self.step_cost.bucket_for(tokens)
        seconds = self._idle.get((bucket, verifies))
        if seconds is None:
            verify = self.verify_cost.base_seconds(bucket) if verifies and self.verify_cost is not None else None
            seconds = verify or self.step_cost.base_seconds(bucket) or 0.0
        if self.program_seconds is not None:
            seconds += self.program_seconds(bucket, drafting_program)
        return seconds

    def observe(self, seconds: float, read_first: bool, running: int, tokens: int, verifies: bool = False,
                drafting_program: bool = False) -> None:
        """One engine-loop period: `read_first`, whether the call read the step in flight before planning;
        the step it waited for held `tokens` tokens (`verifies`: some of them drafts; `drafting_program`:
        the proposer's program after it drafted) while `running` sequences ran."""
        last, self._last_kind = self._last_kind, read_first
        self.periods += 1
        if last != read_first or running == 0:
            return
        device = self.device_seconds(tokens, verifies, drafting_program)
        key = (read_first, width_class(running))
        average = self._residual.get(key)
        if average is None:
            prior = self._read_first_prior(running) if read_first else None
            average = self._residual[key] = Average(prior)
        if average.weight:
            seconds = min(seconds, CLIP * max(device + average.value, 1e-6))
        average.add(seconds - device, self.periods)

    def skip(self, read_first: bool) -> None:
        """A period not priced (the speculator samples them while standing by): only its kind counts, for
        the next one's."""
        self._last_kind = read_first
        self.periods += 1

    def planned(self, seconds: float, running: int) -> None:
        """Host seconds from the start of an overlapped step's planning to its launch."""
        width = width_class(running)
        average = self._planning.get(width)
        if average is None:
            average = self._planning[width] = Average()
        average.add(seconds, self.periods)

    def idle(self) -> None:
        """The engine idled: the next period starts a new run of periods."""
        self._last_kind = None

    def measured(self, running: int) -> bool:
        """Whether plain steps at this width have been measured (predictions need them)."""
        average = self._residual.get((False, width_class(running)))
        return self.calibrated and average is not None and average.count >= MIN_PERIODS

    def stale(self, running: int) -> bool:
        """Whether plain steps at this width were last measured REFRESH_PERIODS periods ago or more."""
        average = self._residual.get((False, width_class(running)))
        return average is not None and self.periods - average.at >= REFRESH_PERIODS

    def residual(self, read_first: bool, running: int) -> float:
        width = width_class(running)
        if not read_first:
            overlapped = self._residual.get((False, width))
            return overlapped.value if overlapped is not None else 0.0
        measured = self._residual.get((True, width))
        return measured.value if measured is not None else self._read_first_prior(running)

    def _read_first_prior(self, running: int) -> float:
        overlapped = self._residual.get((False, width_class(running)))
        planning = self._planning.get(width_class(running))
        return (overlapped.value if overlapped is not None else 0.0) + (planning.value if planning is not None else 0.0)

    def read_first_extra(self, running: int) -> float:
        """What reading first adds to a step without drafts: the price of the step after a drafting one."""
        return max(self.residual(True, running) - self.residual(False, running), 0.0)

    def plain_seconds(self, running: int) -> float:
        return self.device_seconds(running, False, False) + self.residual(False, running)

    def drafting_seconds(self, running: int, drafts: int) -> float:
        """A step of `running` sequences verifying `drafts` drafts in all (read first)."""
        return self.device_seconds(running + drafts, drafts > 0, True) + self.residual(True, running)

    def summary(self, running: int) -> str:
        """The estimates at a width, for the log."""
        if not self.measured(running):
            return f"{width_class(running)}+ sequences: plain steps not measured yet"
        measured = (True, width_class(running)) in self._residual  # from periods, not the prior alone
        return (f"{width_class(running)}+ sequences: plain step {1e3 * self.plain_seconds(running):.2f} ms, "
                f"read first {1e3 * self.drafting_seconds(running, 0):.2f} ms"
                f"{'' if measured else ' (not measured yet: from the host planning time)'}")
