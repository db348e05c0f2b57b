"""A constrained choice's grammar, step by step: the mask of its next draw, and closing within its budget.

1. `GrammarState` is one choice's place in its grammar (a `Matcher`) plus its plan for ending in time.
   Before each draw `prepare_draw` decides whether the draw is free (the grammar's mask) or forced (the
   next token of the way out); `masks` writes a step's rows accordingly. The state changes only when a
   token is accepted (`accept`), never when a mask is built, so a draw that is discarded (its request
   preempted meanwhile) and drawn again gets the same mask.
2. Closing: near the end of its token budget a constrained choice is steered to the end of its grammar,
   so its output is complete (JSON that parses) rather than cut off. Once the way out the host finds is
   about as long as the draws left, its tokens are forced, one per draw. Closer to the budget each free
   draw is guarded: one that lengthens the way out beyond the draws left is replaced by the first token
   of the way out from before it (the draw was not fed to the model yet, so nothing is undone).
"""

from __future__ import annotations

import logging

import numpy as np

from jaxserve.sampling.grammar import CLOSE_MARGIN, GUARD_WINDOW, GrammarCompiler, Matcher

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, matcher: Matcher, compiler: GrammarCompiler, eos_ids: tuple[int, ...]):
        self.matcher = matcher
        self.compiler = compiler
        self.eos_ids = eos_ids
        self.closing: list[int] | None = None  # the tokens still to force to end the grammar within budget
        self.forced: int | None = None  # what the next draw is forced to (the head of `closing`)
        self.next_walk = 0  # tokens the choice will have when it next looks for a way out
        self.guarded = False  # close to its budget: each free draw is checked before it is kept
        self.gap = self.margin = 0  # spare draws beyond the way out, and how few of them trigger closing

    @property
    def closed_early(self) -> bool:
        """The closing walk steered the output (its end was forced by the budget)."""
        return self.closing is not None

    # ---- before a draw -----------------------------------------------------------------------------

    def prepare_draw(self, drawn: int, max_len: int) -> None:
        """Plan the draw that follows `drawn` known tokens (of at most `max_len`)."""
        if self.closing is None and drawn >= self.next_walk:
            left = max_len - drawn  # draws left, this one included
            self._plan(self.compiler.closing(self.matcher, 2 * left + CLOSE_MARGIN), left, drawn)
        self.forced = self.closing[0] if self.closing else None

    def _plan(self, path: list[int] | None, left: int, drawn: int) -> None:
        """Given the way out found with `left` draws to go after `drawn` tokens: close now, or guard each
        draw from now on, or walk again later."""
        way_out = len(path) if path is not None else 2 * left + CLOSE_MARGIN
        # One free draw can lengthen the way out a lot (entering an object whose required fields must all be
        # written): keep a margin that grows with it; the guard catches the jumps the margin misses.
        margin = CLOSE_MARGIN + way_out // 2
        gap = left - way_out
        self.gap, self.margin = gap, margin
        if path is not None and gap <= margin:
            self.closing, self.guarded = path, False
            return
        self.guarded = path is not None and gap <= margin + GUARD_WINDOW
        # Unguarded, each free draw shrinks the gap by about CLOSE_MARGIN + 1: walk again before it can close.
        self.next_walk = drawn + (1 if self.guarded else max(1, (gap - margin) // (CLOSE_MARGIN + 1)))

    # ---- a drawn token -----------------------------------------------------------------------------

    def accept(self, token: int, known: int, max_len: int) -> tuple[int, bool]:
        """The token drawn after `known` tokens, before it is kept: returns the token to keep and whether
        the guard replaced it. A forced draw moves the closing path on."""
        if self.forced is not None:
            self.closing.pop(0)
            self.forced = None
            return token, False
        if self.guarded:
            return self._guard(token, known, max_len)
        return token, False

    def _guard(self, token: int, known: int, max_len: int) -> tuple[int, bool]:
        if token in self.eos_ids:
            return token, False
        tokens_after = known + 1
        if self.compiler.keeps_way_out(self.matcher, token):  # most draws: no walk needed
            self.gap -= 1
            self.next_walk = tokens_after + (self.gap > self.margin)  # walk, and close, once it is spent
            return token, False
        left = max_len - tokens_after  # draws left once this token is kept
        after = self.compiler.closing(self.matcher, 2 * left + CLOSE_MARGIN, after=token)
        if after is not None and len(after) <= left:
            self._plan(after, left, tokens_after)
            return token, False
        instead = self.compiler.closing(self.matcher, left + 1)
        if instead is None:  # no way out from before the draw either: keep it (best effort)
            return token, False
        self.closing, self.guarded = instead[1:], False
        return instead[0], True

    def consume(self, token: int, request_id: str) -> str | None:
        """Advance the grammar by a kept token (not EOS): "stop" once the grammar is complete (also when the
        closing walk steered it there: the output is whole, as vLLM reports a grammar that ended), "abort" if
        the token broke it (only when the grammar ran out of work limits and its draw went unconstrained),
        else None."""
        if not self.matcher.consume(token):
            logger.warning("request %s: structured output ended: %s", request_id,
                           self.matcher.error or "the grammar refused a token")
            return "abort"
        return "stop" if self.matcher.done else None


def fill_masks(compiler: GrammarCompiler, rows: list[tuple[int, GrammarState]], num_rows: int) -> np.ndarray:
    """The allowed-token bitmask of a step's sequence rows ([num_rows, ceil(vocab / 32)] int32, token t at
    bit t % 32 of word t // 32): each (row, state) constrained, every other row all ones."""
    masks = np.full((num_rows, compiler.mask_words), -1, np.int32)
    free = []
    for row, state in rows:
        if state.forced is None:
            free.append((state.matcher, row))
        else:
            masks[row] = 0
            masks[row, state.forced // 32] = np.int32(np.uint32(1 << (state.forced % 32)).view(np.int32))
    if free:
        compiler.fill_masks(free, masks)
    for matcher, row in free:
        if matcher.error:  # out of work fuel: this draw goes unconstrained and the choice ends after it
            masks[row] = -1
    return masks
