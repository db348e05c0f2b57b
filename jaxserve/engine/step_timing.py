"""Step times for the scheduler's step-time model (`jaxserve/scheduling/step_cost.py`), as the engine
measures them.

1. Calibration: once every program is compiled, an idle step of each bucket is timed (one under a second
   twice, the faster counting: a program's first run pays a one-off cost, ~65 ms on the 124.7M model on
   CPU, which doubled its decode step's reading), while no request runs: at warm-up, or a bucket per
   idle moment of a server whose programs compiled in the background. Between the two, a short step's
   program runs the warm-up batches (`BatchBuilder.warmup`): the first time a program enters a loop or
   a branch costs it another one-off, and an idle step enters neither, so the first requests paid it
   (5-30 ms a program on stories260K, up to doubling the first few steps' time). Not in a multi-host run: its
   processes would have to run the timing steps together; its model learns from served steps alone.
2. Online: each step whose samples the host waited for is measured from when the device could start it
   (its launch, or the end of the step before) to their arrival (`StepClock`).
3. With speculative decoding, a step that verifies drafts runs its program's draft rows (an LM head and a
   draw per row): such steps are timed at warm-up (an idle batch of drafts per bucket) and measured online
   into the speculator's own model (`Speculator.verify_cost`), which prices drafting, and not into the
   scheduler's, which prices plain steps.
"""

from __future__ import annotations

import logging

import jax

from jaxserve.execution.runner import LaunchedStep
from jaxserve.scheduling.step_cost import StepClock, kv_tokens_read

logger = logging.getLogger("jaxserve.engine.engine")
SHORT_STEP_SECONDS = 1.0  # an idle step this short is timed twice
# A program whose idle step is this short also runs the warm-up batches; beside a longer step their one-off
# costs are small, and running them would add seconds to the start of a large model on a CPU.
WARMUP_BATCHES_BELOW_SECONDS = 0.1


class StepTiming:
    """The engine's step times, fed to the scheduler's step-time model (and the speculator's): the buckets
    timed idle, and the clock of served steps. Owned by `Engine`, which calls `calibrate` while no request
    runs and `measure` on each step it reads."""

    def __init__(self, runner, scheduler, speculator=None):
        self.runner = runner
        self.scheduler = scheduler
        self.speculator = speculator
        self.clock = StepClock()  # device times of the steps read
        self.timed_buckets: set[int] = set()  # buckets whose idle step has been timed

    def calibrate(self, max_buckets: int | None = None) -> None:
        """Time an idle step of (up to `max_buckets`) buckets not timed yet for the scheduler's step-time
        model; one under SHORT_STEP_SECONDS twice, the faster counting (a program's first run pays a
        one-off cost of tens of milliseconds; a long step is timed once, where that cost is small beside
        it and a second run would add seconds to the start of a big model). In between, a program with a
        step under WARMUP_BATCHES_BELOW_SECONDS runs the warm-up batches. Only while no request runs (the
        caller's to make sure: an idle server times a bucket per idle moment once background compilation
        is done); in a multi-host run the model learns from served steps alone."""
        if not self.due:
            return
        buckets = [b for b in self.runner.ready_buckets if b not in self.timed_buckets][:max_buckets]
        cost = self.scheduler.step_cost
        # A program's first runs may compile what runs inside it on the host (the interpreted kernels'
        # callbacks on CPU, on whichever thread XLA runs them): that is start-up's, not a served step's.
        with self.runner.events.counting(warmup=True):
            for bucket in buckets:
                seconds = self.runner.time_idle_step(bucket)
                if seconds < WARMUP_BATCHES_BELOW_SECONDS:
                    self.runner.run_warmup_batches(bucket)
                if seconds < SHORT_STEP_SECONDS:
                    seconds = min(seconds, self.runner.time_idle_step(bucket))
                cost.observe(bucket, 0, seconds)
                if self.speculator is not None:
                    self.speculator.cost.timed_idle(bucket, False, seconds)
                    if bucket > 1:  # a step verifying drafts draws more rows
                        verify = self._time_verify_step(bucket)
                        self.speculator.verify_cost.observe(bucket, 0, verify)
                        self.speculator.cost.timed_idle(bucket, True, verify)
                self.timed_buckets.add(bucket)
        if self.due:
            return  # the log line comes with the last bucket
        target = self.scheduler.itl_target()
        logger.info("step times (ms) by token bucket: %s; inter-token latency target %s",
                    ", ".join(f"{b}: {1e3 * cost.base_seconds(b):.1f}" for b in sorted(self.timed_buckets)),
                    "off" if target is None else f"{1e3 * target:.1f} ms" + (
                        " at no context (derived: it grows with the decoding streams' context)"
                        if self.scheduler.config.target_itl is None else ""))

    def _time_verify_step(self, bucket: int) -> float:
        """A step verifying drafts, idle (on the null page): twice when short, the faster counting."""
        seconds = self.runner.time_idle_step(bucket, verify=True)
        if seconds < SHORT_STEP_SECONDS:
            seconds = min(seconds, self.runner.time_idle_step(bucket, verify=True))
        return seconds

    @property
    def due(self) -> bool:
        """Every program is compiled and some bucket's step has not been timed yet (never in a multi-host
        run: its processes would have to run the timing steps together)."""
        return (jax.process_count() == 1 and self.runner.warmup_report is not None
                and len(self.timed_buckets) < len(self.runner.ready_buckets))

    def measure(self, launched: LaunchedStep) -> None:
        """Feed the step-time model the step's device time, where it can be told."""
        if launched.done_at is None:
            return  # a runner that keeps no times
        seconds = self.clock.device_seconds(launched.launched_at, launched.done_at, launched.waited)
        if seconds is not None:
            # A step verifying drafts runs its program's draft rows: its time is not a plain step's.
            verifies = self.speculator is not None and launched.step.verifies_drafts
            cost = self.speculator.verify_cost if verifies else self.scheduler.step_cost
            cost.observe(launched.bucket, kv_tokens_read(launched.step), seconds)
