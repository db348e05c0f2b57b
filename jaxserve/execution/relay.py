"""Multi-host: the runner of each process, wrapped so that every process runs the leader's steps.

Every jitted step is one SPMD program over all hosts, so every process must call it with the same inputs
in the same order. Only process 0 (the leader) schedules; the others follow (see `sharding/multihost.py`
for why the packed batch is broadcast rather than the scheduler replicated).
1. `runner_for_this_process` picks the runner class once, at start: the plain `ModelRunner` in a
   single-process run (nothing here is on its path), `LeaderRunner` on process 0, `FollowerRunner` on
   the others. Callers use the same interface either way.
2. `LeaderRunner.dispatch` broadcasts each step's header and packed buffers (and masks) before running it;
   its warm-up compiles by running an empty step of each bucket, so the followers compile as it reaches
   them. Each caller's call (`call`: an `LLM.generate`, warm-up, a server's lifetime) ends with a
   broadcast END that returns the followers from `follow`.
3. `FollowerRunner.call` runs the leader's steps, in order, until that END, and answers `on_follower`.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.compiler import WarmupReport
from jaxserve.execution.runner import LaunchedStep, ModelRunner
from jaxserve.scheduling.step import StepPlan
from sharding.multihost import END, STEP, StepChannel

_WITH_LOGITS, _HAS_MASKS, _PLAIN = 1, 2, 4  # bits of the step header's flag (_PLAIN: the bucket's plain program)


def runner_for_this_process(*args, **kwargs) -> ModelRunner:
    """A `ModelRunner` (arguments as its own) for this process's part in the run."""
    if jax.process_count() == 1:
        return ModelRunner(*args, **kwargs)
    return (LeaderRunner if jax.process_index() == 0 else FollowerRunner)(*args, **kwargs)


class LeaderRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = StepChannel()

    def dispatch(self, step: StepPlan | None, layout: BatchLayout, ints: np.ndarray, floats: np.ndarray,
                 masks: np.ndarray | None, with_logits: bool, images=None) -> LaunchedStep:
        if images is not None:  # the engine loads no vision encoder on a multi-host mesh
            raise NotImplementedError("image inputs are not relayed to follower processes")
        flags = (int(with_logits) | (_HAS_MASKS if masks is not None else 0)
                 | (_PLAIN if layout is self.compiler.plain_layouts.get(layout.tokens) else 0))
        self.channel.send(STEP, layout.tokens, flags, (ints, floats) if masks is None else (ints, floats, masks))
        return super().dispatch(step, layout, ints, floats, masks, with_logits)

    def warmup(self, background: bool = False, on_done=None) -> WarmupReport | None:
        # The followers compile as the leader's steps reach them: one program at a time, in the foreground.
        return self.call(lambda: self._warm_up(on_done))

    def _warm_up(self, on_done) -> WarmupReport | None:
        report = super().warmup(False, on_done)
        self.forget_samples()  # the warm-up ran steps (on the null page)
        return report

    def _build_program(self, layout: BatchLayout) -> None:
        # Every process must compile the program its collectives run. No sequences: every token writes to
        # the null page.
        jax.block_until_ready(self.dispatch(None, layout, *layout.empty(), None, with_logits=False).outputs)

    def call(self, work, on_follower=None):
        try:
            return work()
        finally:
            self.release()

    def release(self) -> None:
        self.channel.send(END)


class FollowerRunner(ModelRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.channel = StepChannel()

    def warmup(self, background: bool = False, on_done=None) -> WarmupReport | None:
        self.follow()  # the leader's warm-up steps compile the programs here
        self.state  # noqa: B018 - the cache was filled on its thread meanwhile
        if on_done is not None:
            on_done(None)
        return None

    def call(self, work, on_follower=None):
        self.follow()
        return on_follower

    def follow(self) -> int:
        """Run the leader's steps, in order, until it ends the call. Returns the steps run."""
        steps = 0
        while True:
            kind, tokens, flag = self.channel.receive_header()
            if kind == END:
                return steps
            if kind != STEP:
                raise RuntimeError(f"unknown step kind {kind} from the leader")
            layout = self.compiler.bucket_layouts(tokens)[-1 if flag & _PLAIN else 0]
            template = layout.empty()
            if flag & _HAS_MASKS:
                ints, floats, masks = self.channel.receive_batch((*template, self._all_allowed(layout.seqs)))
                masks = np.asarray(masks)
            else:
                (ints, floats), masks = self.channel.receive_batch(template), None
            self.dispatch(None, layout, np.asarray(ints), np.asarray(floats), masks, bool(flag & _WITH_LOGITS))
            steps += 1
