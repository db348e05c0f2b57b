"""Multi-host: the runner of each process, wrapped so that every process runs the leader's steps.

Every jitted step is one SPMD program over all hosts, so every process must call it with the same inputs
in the same order. Only process 0 (the leader) schedules; the others follow (see `sharding/multihost.py`
for why the packed batch is broadcast rather than the scheduler replicated).
1. `runner_for_this_process` picks the runner class once, at start: the plain `ModelRunner` in a
   single-process run (nothing here is on its path), `LeaderRunner` on process 0, `FollowerRunner` on
   the others. Callers use the same interface either way.
2. `LeaderRunner.dispatch` broadcasts each step's header and packed buffers (and masks) before running it;
   a vision model's step with image tokens also sends its encoder rows, gathered on the leader, which alone
   loads the encoder (a header bit; a second broadcast, so a text step's relay is unchanged). Rows, not
   pixels: Gemma 3's 896-pixel image is 9.6 MB of float32 pixels, its 256 rows 1.3 MB (bfloat16, 4B
   model), and the followers need no encoder, cache or copy of its weights. Its warm-up compiles by running
   an empty step of each bucket (with image rows: each bucket's relay of them compiles there too), so the
   followers compile as it reaches them. Each caller's call (`call`: an `LLM.generate`, warm-up, a server's
   lifetime) ends with a broadcast END that returns the followers from `follow`.
3. `FollowerRunner.call` runs the leader's steps, in order, until that END, and answers `on_follower`.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.compiler import WarmupReport
from jaxserve.execution.image_rows import EncoderRows
from jaxserve.execution.runner import LaunchedStep, ModelRunner
from jaxserve.scheduling.step import StepPlan
from sharding.multihost import END, STEP, StepChannel

# Bits of the step header's flag (_PLAIN: the bucket's plain program; _HAS_IMAGES: encoder rows follow the batch).
_WITH_LOGITS, _HAS_MASKS, _PLAIN, _HAS_IMAGES = 1, 2, 4, 8


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
                 masks: np.ndarray | None, with_logits: bool, images: EncoderRows | None = None) -> LaunchedStep:
        flags = (int(with_logits) | (_HAS_MASKS if masks is not None else 0)
                 | (_HAS_IMAGES if images is not None else 0)
                 | (_PLAIN if layout is self.compiler.plain_layouts.get(layout.tokens) else 0))
        self.channel.send(STEP, layout.tokens, flags, (ints, floats) if masks is None else (ints, floats, masks))
        if images is not None:
            self.channel.send_batch(images)
        return super().dispatch(step, layout, ints, floats, masks, with_logits, images)

    def warmup(self, background: bool = False, on_done=None) -> WarmupReport | None:
        # The followers compile as the leader's steps reach them: one program at a time, in the foreground.
        return self.call(lambda: self._warm_up(on_done))

    def _warm_up(self, on_done) -> WarmupReport | None:
        report = super().warmup(False, on_done)
        self.forget_samples()  # the warm-up ran steps (on the null page)
        return report

    def _build_program(self, layout: BatchLayout) -> None:
        # Every process must compile the program its collectives run. No sequences: every token writes to
        # the null page. Where the steps take image rows, blank ones go along: their relay compiles here, not
        # at the first image.
        images = None if self.image_rows is None else self.image_rows.empty(layout.tokens)
        jax.block_until_ready(self.dispatch(None, layout, *layout.empty(), None, False, images).outputs)

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
            images = self.channel.receive_batch(self.image_rows.empty(tokens)) if flag & _HAS_IMAGES else None
            self.dispatch(None, layout, np.asarray(ints), np.asarray(floats), masks, bool(flag & _WITH_LOGITS),
                          images)
            steps += 1
