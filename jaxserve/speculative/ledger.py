"""What drafting really paid against what the payoff charged for it: the guard on drafting's payoff
(`payoff.py`).

The payoff decides from predictions: each sequence's acceptance so far (`acceptance.py`) and each step's
cost as measured (`cost.py`). Where they are off in the same direction every time, measuring more does not
fix the decisions: a verifying step's device time is its idle step's, timed at warm-up, and the residual
it leaves is learnt over all the read-first periods, most of which do not wait for one; and a drafting
step's price leaves out the step after it, which reads first too, unless that one drafts as well.
On stories260K at 4 streams the drafting steps, 1-2% of them, made the server 6% slower than speculation
off: offline, they realized the tokens they were charged for, at four times the seconds (a verifying
step's read took 5-9 ms where warm-up had timed 2.6-4.7, and the step after it reads first as well).

So every step that drafts (probes included) is booked, per width, as charged (the tokens it was expected
to add and the seconds over a plain step its decision used, uncorrected) and as realized (the drafts that
stood; the periods it was served in, its own and the next one, which waits for it, over a plain step's
predicted time). Over about the last `MEMORY_STEPS` steps booked:
- where the drafts that stood outweigh the tokens plain steps would have made in the realized extra
  seconds, drafting paid: nothing is corrected, however far the predictions were off;
- where they do not, drafting lost, and each side of a decision at that width is corrected by what it
  realized: every expected gain is multiplied by the share of the charged tokens that stood (at most 1, at
  least `FLOOR`), and every drafting step is priced at the seconds per booked step that drafting took
  beyond those charged (the surcharge). The surcharge is added, not multiplied: what the predictions leave
  out is mostly a fixed cost of drafting at all (the read-first step after it, a verifying step's slower
  read), not one that grows with the drafts. Scaling the gains by the seconds' bias instead, held at 20%,
  still let drafting through on stories260K at 4 streams, where it took 2-6.5 times the seconds charged
  and served 0.94x speculation off.
Probes are booked too: where the corrections keep drafting off, they are what can show that it pays again
(acceptance up, verify steps cheaper), and lift them. Too few steps booked (`MIN_STEPS`) tell nothing.
"""

from __future__ import annotations

import collections

from jaxserve.speculative.cost import width_class

MEMORY_STEPS = 32  # drafting steps the book remembers (an exponential memory)
# Drafting steps booked (decayed) before the book counts. Until then a width drafts by the predictions
# alone: on stories260K served, a fresh server's first level at 4 streams drafted on 45-57 steps, at widths
# 1-4, each realizing 3-4 ms over a plain step against under 1 ms charged (0.94-0.98x speculation off, against
# 0.99-1.06x in the rounds after), with 8 here.
MIN_STEPS = 4.0
FLOOR = 0.2


class _Book:
    """One width's decayed sums: steps booked, tokens and extra seconds charged, and realized."""
    __slots__ = ("steps", "charged_tokens", "charged_seconds", "tokens", "seconds")

    def __init__(self):
        self.steps = self.charged_tokens = self.charged_seconds = self.tokens = self.seconds = 0.0

    def paid(self, plain_rate: float) -> bool:
        """Whether the drafts that stood made up for the tokens plain steps would have made in the extra
        seconds (`plain_rate`: their tokens per second), or too few steps are booked to tell."""
        return self.steps < MIN_STEPS or self.tokens >= self.seconds * plain_rate

    def token_share(self) -> float:
        """Drafts that stood over the tokens charged (FLOOR..1)."""
        if self.charged_tokens <= 0:
            return 1.0
        return min(max(self.tokens / self.charged_tokens, FLOOR), 1.0)

    def surcharge(self) -> float:
        """Seconds per booked step that drafting took beyond those charged (0 where it took no more)."""
        return max(self.seconds - self.charged_seconds, 0.0) / self.steps if self.steps else 0.0


class Ledger:
    """Per width class: drafting steps' charged and realized tokens and seconds, and the discount."""

    def __init__(self):
        self._books: collections.defaultdict[int, _Book] = collections.defaultdict(_Book)

    def _book(self, running: int) -> _Book:
        return self._books[width_class(running)]

    def charged(self, running: int, tokens: float, seconds: float) -> None:
        """A drafting step was decided on expecting `tokens` more tokens for `seconds` more than a plain
        step (undiscounted: what the predictions said). The book's memory moves on a step."""
        book = self._book(running)
        keep = 1 - 1 / MEMORY_STEPS
        book.steps = book.steps * keep + 1
        book.charged_tokens = book.charged_tokens * keep + tokens
        book.charged_seconds = book.charged_seconds * keep + seconds
        book.tokens *= keep
        book.seconds *= keep

    def spent(self, running: int, seconds: float) -> None:
        """A drafting step's period (its own, or the next one) took `seconds` more than a plain step's
        predicted time."""
        self._book(running).seconds += seconds

    def stood(self, running: int, tokens: int) -> None:
        """Of the drafts a drafting step verified for a sequence, `tokens` stood."""
        self._book(running).tokens += tokens

    def _losing(self, running: int, plain_rate: float) -> _Book | None:
        book = self._books.get(width_class(running))
        return None if book is None or book.paid(plain_rate) else book

    def discount(self, running: int, plain_rate: float) -> float:
        """What the expected gains at this width are multiplied by (FLOOR..1): the share of the charged
        tokens that stood, where drafting lost (`plain_rate`: plain steps' tokens per second at this
        width); 1 where it paid."""
        book = self._losing(running, plain_rate)
        return 1.0 if book is None else book.token_share()

    def surcharge(self, running: int, plain_rate: float) -> float:
        """Seconds added to the price of a drafting step at this width: what drafting took per step beyond
        what it was charged, where it lost; 0 where it paid."""
        book = self._losing(running, plain_rate)
        return 0.0 if book is None else book.surcharge()

    def summary(self, running: int, plain_rate: float) -> str:
        book = self._books.get(width_class(running))
        if book is None or not book.charged_tokens:
            return "no drafting steps booked"
        verdict = ("paying" if book.paid(plain_rate) else f"losing: gains discounted to {book.token_share():.0%}, "
                   f"{book.surcharge() * 1e3:.2f} ms added a step")
        # Seconds a step, not a ratio: a drafting step's charge can be next to nothing.
        return (f"drafting steps realized {book.tokens / book.charged_tokens:.0%} of the tokens charged, and "
                f"{book.seconds / book.steps * 1e3:.2f} ms a step over a plain one against "
                f"{book.charged_seconds / book.steps * 1e3:.2f} ms charged, {verdict}")
