"""`DraftingPayoff` (jaxserve/speculative/payoff.py), driven by a scripted engine: drafting pauses at a batch
width while plain steps measure faster there, comes back when drafting measures faster, both kinds keep
being measured, and widths are judged apart."""

from jaxserve.speculative.payoff import MARGIN, DraftingPayoff, width_class


class Load:
    """A scripted engine: each step takes 10 ms and makes `rate x 10 ms` tokens for each running sequence,
    the rate depending on whether the step drafts."""

    def __init__(self, payoff: DraftingPayoff):
        self.now = 0.0
        self.tokens = 0
        self.payoff = payoff
        payoff.clock = lambda: self.now

    def steps(self, count: int, drafting_rate: float, plain_rate: float, running: int = 4) -> list[bool]:
        """Run `count` steps; whether each drafted."""
        kinds = []
        for _ in range(count):
            drafting = self.payoff.allows_drafting()
            kinds.append(drafting)
            self.now += 0.010
            self.tokens += round((drafting_rate if drafting else plain_rate) * 0.010 * running)
            self.payoff.record_step(self.tokens, running)
        return kinds


def payoff_and_load() -> tuple[DraftingPayoff, Load]:
    payoff = DraftingPayoff(window_steps=4, probe_every=4)
    return payoff, Load(payoff)


def test_width_classes_are_powers_of_two():
    assert [width_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 17)] == [1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_drafting_pauses_while_plain_steps_are_faster_and_is_still_probed():
    payoff, load = payoff_and_load()
    first = load.steps(12, drafting_rate=400, plain_rate=1000)
    assert first[:5] == [True] * 5  # the anchor step and the first window draft; the second window is plain
    assert False in first[5:]
    kinds = load.steps(400, drafting_rate=400, plain_rate=1000)
    assert payoff.prefer_drafting[4] is False
    assert 0.05 < sum(kinds) / len(kinds) < 0.3  # drafting only in probe windows (one in four, and anchors)
    assert payoff.rates[(4, False)] > payoff.rates[(4, True)] * (1 + MARGIN)
    assert abs(payoff.rates[(4, True)] - 400) < 40 and abs(payoff.rates[(4, False)] - 1000) < 100


def test_drafting_stays_where_it_pays_and_comes_back_when_it_pays_again():
    payoff, load = payoff_and_load()
    kinds = load.steps(400, drafting_rate=1500, plain_rate=1000)
    assert payoff.prefer_drafting.get(4, True) and sum(kinds) / len(kinds) > 0.7
    load.steps(400, drafting_rate=500, plain_rate=1000)
    assert payoff.prefer_drafting[4] is False
    load.steps(400, drafting_rate=2000, plain_rate=1000)
    assert payoff.prefer_drafting[4] is True


def test_idle_gaps_and_noise_within_the_margin_do_not_decide():
    payoff, load = payoff_and_load()
    for _ in range(20):
        load.steps(20, drafting_rate=1000, plain_rate=1000 * (1 + MARGIN / 2))
        load.now += 5.0  # idle: nothing runs, the open window is dropped
        payoff.record_step(load.tokens, 0)
    assert payoff.prefer_drafting.get(4, True)
    assert abs(payoff.rates[(4, True)] - 1000) < 50  # the idle seconds never entered a rate


def test_each_width_is_judged_on_its_own():
    """Drafting pays for one sequence and loses for sixteen: each width keeps its own answer, and the
    kind follows the width of the batch being served."""
    payoff, load = payoff_and_load()
    for _ in range(30):
        load.steps(40, drafting_rate=1500, plain_rate=1000, running=1)
        load.steps(40, drafting_rate=300, plain_rate=1000, running=16)
    assert payoff.prefer_drafting.get(1, True) is True and payoff.prefer_drafting[16] is False
    narrow = load.steps(40, drafting_rate=1500, plain_rate=1000, running=1)
    wide = load.steps(40, drafting_rate=300, plain_rate=1000, running=16)
    assert sum(narrow) > 25 and sum(wide) < 15
