"""Drafting's payoff (jaxserve/speculative/payoff.py, acceptance.py, cost.py) without a model: a scripted
machine gives each kind of step its time (a device time per token bucket, host time with and without reading
the step in flight first) and each sequence its true acceptance per draft position, and the payoff decides
every step as the speculator does. Where verify rows cost more than their drafts gain, drafting stops after
the first measurements and probes stay within their share; where drafts pay, every step drafts; each
sequence verifies as many drafts as its own acceptance pays for."""

from __future__ import annotations

import random

import pytest

from jaxserve.scheduling.step_cost import StepCostModel
from jaxserve.speculative.acceptance import RETRY_STEPS, Acceptance
from jaxserve.speculative.cost import REFRESH_PERIODS, DraftingCost, width_class
from jaxserve.speculative.ledger import FLOOR, MIN_STEPS, Ledger
from jaxserve.speculative.payoff import MIN_GAIN, PROBE_SHARE, DraftingPayoff, best_drafts

K = 4


def step_cost_model(device: dict[int, float]) -> StepCostModel:
    """A step-time model that measured exactly these device seconds per token bucket."""
    model = StepCostModel(tuple(device))
    for bucket, seconds in device.items():
        model.observe(bucket, 0, seconds)
    return model


class Machine:
    """A scripted engine. `device`: seconds of each token bucket's step; `host`: host seconds a step adds
    when it plans while the device runs (False) and when it reads the step in flight first (True);
    `accept[s]`: sequence s's chance that draft i stands once drafts 1..i-1 have; `verify`: seconds of each
    bucket's step when it verifies drafts (default: `device`). Each step decides as the
    speculator does, samples what stands, and reports the step's time as the engine loop's period."""

    def __init__(self, device: dict[int, float], host: dict[bool, float], accept: list[list[float]],
                 noise: float = 0.1, seed: int = 0, verify: dict[int, float] | None = None,
                 pipelined: bool = False, priced_verify: dict[int, float] | None = None):
        self.device, self.host, self.accept = device, host, accept
        # The engine's pipeline on a host-bound machine: a period waits for the step before (in flight), the
        # longer of its device time and the host's planning when overlapped, their sum when reading first.
        self.pipelined = pipelined
        self.in_flight: tuple[float, int, bool] | None = None  # its device seconds, tokens, drafts?
        self.verify = verify or device  # a step verifying drafts: its program's draft rows run too
        # What the cost model was told a verifying step costs (warm-up timings): by default, the truth.
        self.cost = DraftingCost(step_cost_model(device), step_cost_model(priced_verify or self.verify))
        self.payoff = DraftingPayoff(self.cost)
        self.acceptance = Acceptance(K)
        self.rng = random.Random(seed)
        self.noise = noise
        self.read_next = False  # a step after one that verified drafts reads first
        self.verified_booked = False  # the step before verified drafts the ledger books as drafting's
        self.tokens, self.seconds = 0, 0.0
        self.outcomes: list[str] = []
        self.drafts: list[list[int]] = []

    @property
    def running(self) -> int:
        return len(self.accept)

    def plain_rate(self) -> float:
        """Tokens per second with speculation off."""
        bucket = self.cost.step_cost.bucket_for(self.running)
        if self.pipelined:
            return self.running / max(self.device[bucket], self.host[False])
        return self.running / (self.device[bucket] + self.host[False])

    def stood(self, s: int, drafts: int) -> int:
        for i in range(drafts):
            if self.rng.random() >= self.accept[s][i]:
                return i
        return drafts

    def step(self) -> None:
        keys = range(self.running)
        acceptance = self.acceptance
        expected = [[acceptance.hit(s) * g for g in acceptance.gains(s)] for s in keys]
        decision = self.payoff.before_reading(self.running, expected)
        read_first = decision.drafting or self.read_next
        counts = [0] * self.running
        if read_first:  # the newest tokens are known: every sequence found K drafts
            if decision.drafting:
                for s in keys:
                    acceptance.guessed(s, True)
            counts = self.payoff.after_reading(self.running, [acceptance.gains(s) for s in keys], decision)
        made = self.running
        for s, drafts in enumerate(counts):
            if drafts:
                stood = self.stood(s, drafts)
                acceptance.verified(s, drafts, stood)
                self.payoff.stood(self.running, stood)
                made += stood
        drafted = sum(counts)
        # The ledger's realized side, as the speculator books it: a drafting step's own period, and the next.
        booking = decision.drafting or self.verified_booked
        self.verified_booked = drafted > 0
        bucket = self.cost.step_cost.bucket_for(self.running + drafted)
        device = (self.verify if drafted else self.device)[bucket]
        step = (device, self.running + drafted, drafted > 0)
        if self.pipelined:
            waited, self.in_flight = self.in_flight or step, step
            seconds = waited[0] + self.host[True] if read_first else max(waited[0], self.host[False])
        else:
            waited, seconds = step, device + self.host[read_first]
        seconds *= 1 + self.noise * (2 * self.rng.random() - 1)
        self.cost.observe(seconds, read_first, self.running, *waited[1:])
        self.payoff.served(seconds, self.running if booking else 0)
        acceptance.step()
        self.read_next = drafted > 0
        self.tokens += made
        self.seconds += seconds
        self.outcomes.append("probe" if decision.outcome == "probe" and drafted else
                             "drafting" if drafted else decision.outcome)
        self.drafts.append(counts)

    def run(self, steps: int) -> float:
        """Tokens per second over these steps, against speculation off."""
        tokens, seconds = self.tokens, self.seconds
        for _ in range(steps):
            self.step()
        return (self.tokens - tokens) / (self.seconds - seconds) / self.plain_rate()


# A small model's CPU step: a millisecond of host work, a device time that grows by bucket.
SMALL = {1: 0.5e-3, 2: 0.5e-3, 4: 0.6e-3, 8: 0.8e-3, 16: 1.2e-3, 32: 2.4e-3, 64: 4.0e-3, 128: 8.0e-3}
HOST = {False: 1.0e-3, True: 1.6e-3}


def test_width_classes_are_powers_of_two():
    assert [width_class(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 17)] == [1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_where_verify_rows_cost_more_than_they_gain_nothing_is_drafted_but_rare_probes():
    """Sixteen sequences whose drafts stand one time in five: a drafting step costs more than a plain one
    makes, so after the first measured steps only probes draft, and they take at most their share."""
    machine = Machine(SMALL, HOST, [[0.2] * K] * 16)
    ratio = machine.run(4000)
    outcomes = machine.outcomes
    assert outcomes.count("drafting") <= 3  # the first estimates, before a drafting step was measured
    probes = outcomes.count("probe")
    assert 0 < probes < 0.02 * len(outcomes)
    assert machine.payoff.probe_seconds <= PROBE_SHARE * machine.payoff.served_seconds + 0.01
    assert outcomes[-1000:].count("unprofitable") > 950
    assert ratio > 0.97


def test_drafts_that_pay_are_verified_every_step():
    """One sequence whose drafts mostly stand on a model whose step is mostly the device's: once plain steps
    are measured, every step drafts, and the engine is much faster than without speculation."""
    machine = Machine({1: 20e-3, 2: 21e-3, 4: 24e-3, 8: 28e-3}, {False: 0.5e-3, True: 1.0e-3}, [[0.8] * K])
    ratio = machine.run(400)
    first_drafting = machine.outcomes.index("drafting")
    assert first_drafting <= 4 and machine.outcomes[first_drafting:].count("drafting") == 400 - first_drafting
    assert ratio > 1.5


def test_plain_steps_are_measured_again_while_drafting_pays():
    """While drafting pays every step reads first, so a plain step's cost is never seen again unless it is
    measured on purpose: after REFRESH_PERIODS a few plain steps are, and when plain steps have become the
    faster kind (here their host work fell from 4 ms to 0.2), drafting stops."""
    machine = Machine({1: 2e-3, 2: 2e-3, 4: 2.1e-3, 8: 2.2e-3}, {False: 4e-3, True: 4.2e-3}, [[0.5] * K])
    assert machine.run(REFRESH_PERIODS) > 1.3
    machine.host[False] = 0.2e-3
    machine.run(REFRESH_PERIODS // 2)
    assert machine.outcomes.count("measuring") > 4  # the first plain steps, and those measured again
    # Off but for probes (and a step after one, which reads first anyway and may draft where that pays).
    last = machine.outcomes[-200:]
    assert last.count("drafting") <= 2 and last.count("unprofitable") > 190


@pytest.mark.parametrize("accept, least", [(0.7, 0.97), (0.9, 1.15)])
def test_a_step_after_a_verifying_one_drafts_again_only_where_drafting_beats_plain_steps(accept, least):
    """A host-bound machine (the engine's pipeline): a step after a verifying one reads first whatever it
    does, and drafting again made the step after it read first too. Weighed against that step's own rate
    (its reading already paid), drafting went on step after step where drafts stand 7 times in 10, at 0.90x
    speculation off; weighed against the plain steps it keeps from coming back, it stops there, and still
    runs on every step where 9 in 10 stand."""
    machine = Machine(SMALL, {False: 1.0e-3, True: 1.6e-3}, [[accept] * K] * 4, pipelined=True)
    ratio = machine.run(3000)
    drafting = machine.outcomes[-1000:].count("drafting")
    assert (drafting < 20) if accept < 0.9 else (drafting > 950)
    assert ratio > least


@pytest.mark.parametrize("accept, want", [(0.2, "off"), (0.9, "on")])
def test_the_same_load_drafts_or_not_by_its_acceptance(accept, want):
    machine = Machine(SMALL, HOST, [[accept] * K] * 4)
    ratio = machine.run(2000)
    drafting = machine.outcomes[-500:].count("drafting")
    assert (drafting > 450) if want == "on" else (drafting == 0)
    assert ratio > (1.2 if want == "on" else 0.97)


def test_verify_rows_priced_per_bucket_keep_drafting_to_the_bucket_where_it_pays():
    """A verify step runs a draft row (an LM head and a draw) per row its bucket holds, so it costs more
    than a plain step of the same bucket, the more the bigger the bucket (the 124.7M model's 32000-way head
    on a CPU). At 16 sequences drafts pay in the 32-token bucket and not beyond it."""
    device = {16: 10e-3, 32: 11e-3, 64: 13e-3, 128: 17e-3}
    verify = {16: 10e-3, 32: 14e-3, 64: 40e-3, 128: 90e-3}
    machine = Machine(device, {False: 0.5e-3, True: 1e-3}, [[0.8] * K] * 16, verify=verify)
    assert machine.run(1000) > 1.1
    assert all(sum(counts) <= 16 for counts in machine.drafts[-200:])  # 16 + 16 tokens: the 32 bucket
    assert machine.outcomes[-200:].count("drafting") == 200


@pytest.mark.parametrize("seed", [0, 1])
def test_drafting_that_loses_against_biased_predictions_is_stopped_by_what_it_realized(seed, monkeypatch):
    """Warm-up timed the verifying steps of the 8-token bucket and up at a third of what they cost while
    serving (on stories260K at 4 streams a verifying step's read took 5-9 ms against an idle step timed at
    2.6-4.7). The read-first residual learns part of it, not all: four sequences whose drafts stand 8
    times in 10 drafted in bursts, on 4-14% of the steps (seeds 0-3), and served 0.95-0.98x speculation off.
    The ledger books the drafting steps' realized seconds at twice those charged, and its surcharge stops
    them."""
    verify = {bucket: seconds * (3 if bucket >= 8 else 1) for bucket, seconds in SMALL.items()}

    def machine() -> Machine:
        return Machine(SMALL, HOST, [[0.8] * K] * 4, verify=verify, priced_verify=SMALL, seed=seed)

    guarded = machine()
    ratio = guarded.run(3000)
    assert ratio > 0.98 and guarded.outcomes[-1000:].count("drafting") == 0
    # The drafts stood as expected: the loss is all in the seconds, a verifying step's third of them.
    discount, surcharge = guarded.payoff._corrections(4, 4 / guarded.cost.plain_seconds(4))
    assert discount > 0.9 and surcharge > 0.5e-3
    assert "losing" in guarded.payoff.summary(4)
    with monkeypatch.context() as patch:  # the same machine without the guard
        patch.setattr(DraftingPayoff, "_corrections", lambda self, running, plain_rate: (1.0, 0.0))
        unguarded = machine()
        assert unguarded.run(3000) < ratio - 0.015 and unguarded.outcomes.count("drafting") > 100


def test_the_ledger_corrects_gains_and_seconds_by_what_was_realized_only_where_drafting_lost():
    rate = 1000.0  # plain steps' tokens per second
    ledger = Ledger()

    def book(charged_tokens, charged_seconds, stood, seconds):
        ledger.charged(4, charged_tokens, charged_seconds)
        ledger.stood(4, stood)
        ledger.spent(4, seconds)

    for _ in range(int(MIN_STEPS) - 1):  # charged 2 tokens for 1 ms; realized 2 tokens for 4 ms
        book(2.0, 1e-3, 2, 4e-3)
    assert (ledger.discount(4, rate), ledger.surcharge(4, rate)) == (1.0, 0.0)  # too few steps to tell
    for _ in range(3):  # the memory's weights sum past MIN_STEPS
        book(2.0, 1e-3, 2, 4e-3)
    # The tokens stood as charged; the seconds are 3 ms a step over the charge, added to every decision's.
    assert ledger.discount(4, rate) == 1.0 and ledger.surcharge(4, rate) == pytest.approx(3e-3)
    assert ledger.surcharge(5, rate) == pytest.approx(3e-3) and ledger.surcharge(8, rate) == 0.0  # per width
    assert ("4.00 ms a step over a plain one against 1.00 ms charged, losing: gains discounted to 100%, 3.00 ms "
            "added a step") in ledger.summary(4, rate)
    # Where the drafts that stood outweigh the plain tokens of the extra seconds, nothing is corrected,
    # however far the predictions were off: the guard stops losses, it does not second-guess gains.
    assert (ledger.discount(4, rate / 4), ledger.surcharge(4, rate / 4)) == (1.0, 0.0)
    assert "paying" in ledger.summary(4, rate / 4)
    # Drafts that stand less often than charged discount the gains, down to FLOOR; a step realized under its
    # charge adds nothing.
    for _ in range(100):
        book(2.0, 2e-3, 1, 1.5e-3)
    assert ledger.discount(4, rate) == pytest.approx(0.5, abs=0.02) and ledger.surcharge(4, rate) == 0.0
    for _ in range(100):
        book(2.0, 1e-3, 0, 5e-3)
    assert ledger.discount(4, rate) == FLOOR and ledger.surcharge(4, rate) == pytest.approx(4e-3, rel=0.05)
    # New steps outweigh old ones: the book remembers about the last MEMORY_STEPS.
    for _ in range(100):
        book(2.0, 1e-3, 3, 1e-3)
    assert (ledger.discount(4, rate), ledger.surcharge(4, rate)) == (1.0, 0.0)


def test_drafts_per_sequence_follow_each_ones_acceptance():
    """Two sequences whose first two drafts always stand and the third never does, one whose drafts never
    stand, one whose drafts always do; a token bucket of 12 holds eight drafts at little cost and the next
    one is dear: each sequence verifies the drafts its own acceptance pays for."""
    machine = Machine({4: 10e-3, 12: 11e-3, 16: 30e-3}, {False: 0.5e-3, True: 1e-3},
                      [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], noise=0.0)
    machine.run(100)
    assert machine.drafts[-1] == [2, 2, 0, 4]
    assert machine.outcomes[-1] == "drafting"


def test_best_drafts_fills_a_token_bucket_with_the_likeliest_drafts():
    """Within a bucket extra rows cost nothing, so the choice is each bucket's fullest set of likeliest
    drafts, and a bigger bucket only where its gain pays for it."""
    cost = DraftingCost(step_cost_model({4: 1e-3, 8: 1e-3, 16: 4e-3}))
    gains = [[0.9, 0.8, 0.5, 0.3], [0.6, 0.5, 0.05, 0.01], [0.95, 0.9, 0.85, 0.8], [0.2, 0.15, 0.12, 0.11]]
    counts, gain, seconds = best_drafts(gains, 4, cost, baseline=1e-3, extra=0.0)
    assert counts == [1, 0, 3, 0] and gain == pytest.approx(0.9 + 0.95 + 0.9 + 0.85) and seconds == 1e-3
    assert all(g < MIN_GAIN for g in gains[1][2:])
    # Where the 16-token bucket costs nearly the same, the gains beyond the 8-token bucket are worth it.
    cost = DraftingCost(step_cost_model({4: 1e-3, 8: 1e-3, 16: 1.1e-3}))
    counts, _, _ = best_drafts(gains, 4, cost, baseline=1e-3, extra=0.0)
    assert counts == [4, 2, 4, 4]
    # Where nothing beats the plain step, nothing is drafted.
    assert best_drafts(gains, 4, cost, baseline=0.2e-3, extra=0.0)[0] == [0, 0, 0, 0]


def test_acceptance_is_learnt_per_position_and_per_request():
    acceptance = Acceptance(K)
    new = acceptance.gains(1)
    assert new == sorted(new, reverse=True) and 0 < new[0] < 1
    for _ in range(10):
        acceptance.verified(1, 4, 2)  # positions 1 and 2 stand, 3 does not, 4 is never reached
        acceptance.verified(2, 4, 4)
    first, second = acceptance.gains(1), acceptance.gains(2)
    assert first[0] > 0.9 and first[1] > 0.9 and first[2] < 0.25
    assert second[2] > 0.7 and second[3] > 0.5
    # A new request starts from what the engine has seen: between the two.
    third = acceptance.gains(3)
    assert first[2] < third[2] < second[2]
    # A request that verified nothing for a while starts again from the engine's figures.
    for _ in range(RETRY_STEPS + 1):
        acceptance.step()
    assert acceptance.gains(1)[2] == pytest.approx(acceptance.gains(4)[2])


def test_the_cost_model_counts_periods_of_one_kind_and_clips_pauses():
    cost = DraftingCost(step_cost_model({1: 1e-3, 8: 2e-3}))
    assert not cost.measured(1)
    for _ in range(5):
        cost.observe(1.5e-3, False, 1, 1)  # overlapped: 1 ms device + 0.5 ms residual
    cost.planned(0.3e-3, 1)
    assert cost.measured(1) and cost.plain_seconds(1) == pytest.approx(1.5e-3)
    # Reading first, not measured yet: the overlapped residual plus the host's planning time.
    assert cost.drafting_seconds(1, 4) == pytest.approx(2e-3 + 0.8e-3)
    cost.observe(10e-3, True, 1, 5, True)  # switches kind: mixes both, not counted
    assert cost.drafting_seconds(1, 4) == pytest.approx(2.8e-3)
    cost.observe(100e-3, True, 1, 5, True)  # a pause: clipped to twice the prediction, one period beside the prior
    assert cost.drafting_seconds(1, 4) < 4.3e-3
    for _ in range(40):
        cost.observe(3e-3, True, 1, 5, True)
    assert cost.drafting_seconds(1, 4) == pytest.approx(3e-3, rel=0.05)
    assert cost.read_first_extra(1) == pytest.approx(0.5e-3, rel=0.1)
    # While drafting pays every step reads first: after a long while plain steps are measured again, and
    # the new periods outweigh the old estimate.
    assert not cost.stale(1)
    for _ in range(REFRESH_PERIODS):
        cost.observe(3e-3, True, 1, 5, True)
    assert cost.stale(1)
    for _ in range(4):
        cost.observe(2.5e-3, False, 1, 1)  # plain steps got slower: 1.5 ms of host work
    assert not cost.stale(1) and cost.plain_seconds(1) == pytest.approx(2.5e-3, rel=0.1)


def test_a_draft_models_own_program_is_part_of_a_drafting_steps_cost():
    """A draft model follows every step (its cache must see every token) and drafts only for a step that is
    to draft: its drafting program's time counts in a drafting step, its following program's in a plain one,
    so drafts that would pay on prompt lookup's cost need not pay with a draft model's."""
    device = {1: 10e-3, 8: 11e-3}
    program = {(1, False): 1e-3, (8, False): 1.5e-3, (1, True): 6e-3, (8, True): 8e-3}
    cost = DraftingCost(step_cost_model(device), None, lambda bucket, drafting: program[bucket, drafting])
    for _ in range(4):
        cost.observe(11.5e-3, False, 1, 1)  # device 10 + following 1 + 0.5 of host
    assert cost.plain_seconds(1) == pytest.approx(11.5e-3)
    assert cost.drafting_seconds(1, 3) == pytest.approx(11e-3 + 8e-3 + 0.5e-3)
    payoff = DraftingPayoff(cost)
    expected = [[0.6, 0.36, 0.22]]  # about 1.2 tokens more a step: 2.2 tokens in 19.5 ms against 1 in 11.5
    assert payoff.before_reading(1, expected).outcome == "drafting"
    cost = DraftingCost(step_cost_model(device), None, lambda bucket, drafting: 3 * program[bucket, drafting])
    for _ in range(4):
        cost.observe(13.5e-3, False, 1, 1)
    assert DraftingPayoff(cost).before_reading(1, expected).outcome == "unprofitable"


def test_drafting_is_priced_on_the_idle_steps_timed_at_warm_up():
    """The step-time model learnt online can give a small bucket's whole time to its KV term (one sequence
    whose steps slow as its context grows: the 124.7M model on CPU had its plain one-token step priced 0 ms
    on the device). Weighed against a verify step's device time, a residual measured from that basis priced
    drafting at nearly twice its cost, so drafts that paid 1.6x were left out. The idle steps of both programs,
    timed at warm-up, are one basis: the same periods then price drafting at what it costs."""
    online = StepCostModel((1, 8))
    for kv in range(100, 400, 10):
        online.observe(1, kv, kv * 1e-4)
    assert online.base_seconds(1) == pytest.approx(0.0, abs=1e-9)
    expected = [[0.5, 0.3, 0.2]]  # one token more a step, in all
    outcomes = {}
    for idle in (False, True):
        cost = DraftingCost(online, step_cost_model({8: 34e-3}))
        if idle:
            cost.timed_idle(1, False, 20e-3)
            cost.timed_idle(8, True, 34e-3)
        for _ in range(4):
            cost.observe(28e-3, False, 1, 1)  # plain steps: 20 ms idle, 8 ms of KV read and host work
        cost.planned(1e-3, 1)
        assert cost.plain_seconds(1) == pytest.approx(28e-3)
        outcomes[idle] = DraftingPayoff(cost).before_reading(1, expected).outcome
    assert cost.drafting_seconds(1, 3) == pytest.approx(34e-3 + 8e-3 + 1e-3)  # 2 tokens in 43 ms against 1 in 28
    assert outcomes == {False: "unprofitable", True: "drafting"}


def test_idle_timings_are_an_envelope_so_drafts_never_cost_less_than_none():
    """Each idle step is timed once or twice at warm-up, and on stories260K at 4 streams bucket 4's plain
    step took 2.6 ms against 2.0 ms for bucket 8's verifying one. Taken as timed, four drafts cost less than
    none, and four sequences drafted a draft each, each likely to stand one time in four. As an envelope (a
    bucket's step costs at least a smaller one's, a verifying step at least a plain one of its bucket), such
    drafts do not pay."""
    cost = DraftingCost(step_cost_model({4: 2.6e-3, 8: 2.0e-3}), step_cost_model({4: 2.3e-3, 8: 2.0e-3}))
    for bucket, plain, verify in ((4, 2.6e-3, 2.3e-3), (8, 2.1e-3, 2.0e-3)):
        cost.timed_idle(bucket, False, plain)
        cost.timed_idle(bucket, True, verify)
    assert [cost.device_seconds(t, v, False) for t, v in ((4, False), (4, True), (8, False), (8, True))] == \
        pytest.approx([2.6e-3] * 4)
    for _ in range(4):
        cost.observe(2.8e-3, False, 4, 4)  # plain steps: 0.2 ms of host work beyond the device
    cost.planned(1.0e-3, 4)
    assert cost.drafting_seconds(4, 4) >= cost.drafting_seconds(4, 0) > cost.plain_seconds(4)
    # 5 tokens in 3.8 ms against 4 in 2.8 (as timed: in 3.2 ms, 1.09x plain steps' rate, past the margin)
    assert DraftingPayoff(cost).before_reading(4, [[0.25]] * 4).outcome == "unprofitable"
