"""Whether drafting makes this engine faster, measured while it serves, for each width of batch.

Speculation trades the engine's one-step-ahead overlap (the host plans the next step while the device runs
this one) and the verify tokens' compute for several tokens a step. Where the step is bound by host work (a
tiny model) or the batch is wide, the trade can lose: served on this 2-core machine with every draft
verified, prompt lookup ran stories260K and the 124.7M model at 0.61-0.71x of plain steps at 16 streams and
gained up to 1.3x at one (docs/performance.md, "Speculative decoding"). No batch size fixed in advance
(`disable_by_batch_size`) tells where for every model and machine, so the engine measures:

1. Steps are grouped by batch width: the running sequences, rounded down to a power of two. For each width
   the engine serves in windows of `WINDOW_STEPS` steps, each window drafting or not, and keeps for both
   kinds the output tokens per second per running sequence (an exponential average over windows). A window
   ends early, uncounted, when the width changes or the engine idles; the first step of each window is not
   counted (its tokens come from the step before, of the other kind).
2. At a width, it drafts unless plain windows have measured faster by more than `MARGIN`, and drafts
   again once drafting windows measure faster by as much (the margin keeps noise from flipping it).
3. Every `PROBE_EVERY` windows of a width one runs the other way, so both figures follow the load; the
   first such probe is the width's second window.
Drafting is exact, so which kind a window is changes no request's tokens, only how fast they come.
"""

from __future__ import annotations

import collections
import logging
import time

logger = logging.getLogger(__name__)
WINDOW_STEPS = 16
PROBE_EVERY = 16
MARGIN = 0.05
SMOOTHING = 0.3  # weight of the newest window in each kind's average


def width_class(running: int) -> int:
    """The batch width steps are grouped by: running sequences rounded down to a power of two."""
    return 1 << (running.bit_length() - 1)


class DraftingPayoff:
    def __init__(self, window_steps: int = WINDOW_STEPS, probe_every: int = PROBE_EVERY,
                 clock=time.perf_counter):
        self.window_steps = window_steps
        self.probe_every = probe_every
        self.clock = clock
        self.rates: dict[tuple[int, bool], float] = {}  # (width, drafting?) -> tokens/s per running sequence
        self.prefer_drafting: dict[int, bool] = {}  # width -> the better-measured kind (default: drafting)
        self.windows: collections.Counter = collections.Counter()  # width -> windows completed
        self.drafting = True  # the current window's kind
        self._width: int | None = None  # the current window's width (None: no window open)
        self._steps = 0
        self._seq_steps = 0  # running sequences summed over the window's counted steps
        self._tokens_at = 0  # the output-token count when the window's counting began
        self._seconds = 0.0
        self._last: float | None = None  # when the last counted (or anchoring) step ended

    def allows_drafting(self) -> bool:
        return self.drafting

    def record_step(self, generated_tokens: int, running: int) -> None:
        """After each engine step: `generated_tokens` is the engine's running total of output tokens,
        `running` the sequences it serves (0: idle, the window is dropped)."""
        now = self.clock()
        width = width_class(running) if running else None
        if width != self._width or self._last is None:
            self._open(width, generated_tokens, now)  # this step anchors the new window; it is not counted
            return
        self._seconds += now - self._last
        self._steps += 1
        self._seq_steps += running
        self._last = now
        if self._steps >= self.window_steps:
            self._close(generated_tokens)

    def _restart_count(self, generated_tokens: int) -> None:
        self._steps, self._seq_steps, self._seconds, self._tokens_at = 0, 0, 0.0, generated_tokens

    def _open(self, width: int | None, generated_tokens: int, now: float) -> None:
        self._width = width
        self._restart_count(generated_tokens)
        self._last = None if width is None else now
        if width is not None:
            self.drafting = self._kind_for(width)

    def _kind_for(self, width: int) -> bool:
        probe = self.windows[width] % self.probe_every == 1
        return self.prefer_drafting.get(width, True) != probe

    def _close(self, generated_tokens: int) -> None:
        width, kind = self._width, self.drafting
        rate = (generated_tokens - self._tokens_at) / max(self._seconds, 1e-9) / (self._seq_steps / self._steps)
        old = self.rates.get((width, kind))
        self.rates[(width, kind)] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        self.windows[width] += 1
        self._decide(width)
        self._restart_count(generated_tokens)
        next_kind = self._kind_for(width)
        if next_kind != kind:  # the next step, the other kind's first, only anchors the count
            self.drafting, self._last = next_kind, None

    def _decide(self, width: int) -> None:
        drafting, plain = self.rates.get((width, True)), self.rates.get((width, False))
        if drafting is None or plain is None:
            return
        was = self.prefer_drafting.get(width, True)
        prefer = plain <= drafting * (1 + MARGIN) if was else drafting > plain * (1 + MARGIN)
        if prefer != was:
            logger.info("speculative decoding at %d+ running sequences: %s (per sequence: %.1f tok/s drafting, "
                        "%.1f plain); measured again every %d windows of %d steps", width,
                        "drafting again" if prefer else "plain steps measured faster, drafting paused",
                        drafting, plain, self.probe_every, self.window_steps)
            self.prefer_drafting[width] = prefer
