"""Speculative decoding without a model: the config, the n-gram proposer, the draw rows the batch builder
lays out for drafts, and the on-device verification over hand-made logits."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.execution.batch import BatchBuilder, BatchLayout
from jaxserve.execution.draws import draw
from jaxserve.execution.heads.draw import DrawHead
from jaxserve.sampling.logits import SamplerState
from jaxserve.sampling.params import SamplingParams, seed_words
from jaxserve.sampling.sampler import SamplingArrays, sample
from jaxserve.scheduling.request import Request, Status
from jaxserve.scheduling.stats import EngineStats
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from jaxserve.scheduling.step_cost import StepCostModel
from jaxserve.speculative import ledger, speculator as speculator_module
from jaxserve.speculative.ngram import NgramProposer
from jaxserve.speculative.speculator import Speculator, exact_per_position

VOCAB = 16


def test_config_takes_vllms_json_and_names_what_is_wrong():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)  # vLLM: the missing bound is the other one
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2}).method == "draft_model"
    for bad, words in [("{", "JSON"), ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def request(tokens, **params) -> Request:
    return Request("r", list(tokens), SamplingParams(max_tokens=None, **params), seed=0, max_len=100)


def test_ngram_drafts_what_followed_the_longest_earlier_match():
    proposer = NgramProposer(3, 1, 3)
    r = request([5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 3, 6, 7, 8])
    # "6 7 8" occurred twice before: the latest occurrence was followed by 2 3 6.
    assert proposer.propose([r]) == [[2, 3, 6]]
    r.token_ids += [2, 3, 4]  # a new token the index catches up on: "4" never occurred
    assert proposer.propose([r]) == [[]]
    r.token_ids.append(9)  # the 1-gram "9" was followed by 1
    assert proposer.propose([r]) == [[1, 6, 7]]
    proposer.forget([r.key])
    assert not proposer._tokens


def test_ngram_copy_continues_a_loop_past_the_end():
    proposer = NgramProposer(5, 2, 2)
    assert proposer.propose([request([1, 2, 1, 2])]) == [[1, 2, 1, 2, 1]]


def latest_match_drafts(tokens: list[int], sizes: range, k: int) -> list[int]:
    """Prompt lookup by brute force: the longest tail n in `sizes` that occurred before, at its latest
    occurrence with a token after it; k tokens from there, a copy past the end continuing as a loop."""
    for n in reversed(sizes):
        for start in range(len(tokens) - 1 - n, -1, -1):  # none where n >= len(tokens)
            if tokens[start:start + n] == tokens[-n:]:
                out = tokens[start + n:start + n + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(tokens) - start - n)])
                return out
    return []


def test_ngram_search_drafts_what_a_brute_force_search_does():
    """Token ids whose bytes contain the tail's bytes at another alignment (ids above 2**24) must not
    match; small vocabularies repeat n-grams often, large ones rarely."""
    rng = random.Random(0)
    for _ in range(800):
        vocab = rng.choice([2, 5, 300, 2**24 + 7, 2**31 - 1])
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        tokens = [rng.choice(phrase) if rng.random() < 0.7 else rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        proposer = NgramProposer(4, rng.randrange(1, 3), rng.randrange(3, 6))
        r = request(tokens[:len(tokens) // 2 or 1])
        proposer.prepare([r])  # known in two parts, as a prompt and then its new tokens
        r.token_ids = tokens
        want = latest_match_drafts(tokens, proposer.sizes, 4)
        assert proposer.propose([r]) == [want] and proposer.expects_drafts(r) == bool(want)
    # The tail's bytes (01 02 03 04, little-endian) also span the middle of x and y, later than its own
    # earlier occurrence: that match starts inside a token and is not one.
    tail, x, y = 0x04030201, 0x02011110, 0x21200403
    assert NgramProposer(2, 1, 1).propose([request([tail, 7, x, y, 9, tail])]) == [[7, x]]


def running_request(tokens, **params) -> Request:
    """A request decoding after `tokens`, its newest token known (nothing pending)."""
    r = request(tokens, **params)
    r.status, r.num_computed, r.prefill_target = Status.RUNNING, len(tokens) - 1, len(tokens) - 1
    return r


def step_cost_model(device: dict[int, float]) -> StepCostModel:
    """A step-time model that measured these device seconds per token bucket."""
    model = StepCostModel(tuple(device))
    for bucket, seconds in device.items():
        model.observe(bucket, 0, seconds)
    return model


# What the speculator reads of a launched step (`LaunchedStep`, `StepPlan`), for driving it without a model.
FakePlan = dataclasses.make_dataclass("Plan", ["num_tokens", "verifies_drafts"])
FakeLaunched = dataclasses.make_dataclass("Launched", ["step", ("launched_at", float, 0.0)])


# A model whose step is mostly the weights' read: four tokens cost about what one does, eight do not.
DEVICE = {1: 10e-3, 2: 10e-3, 4: 10.5e-3, 8: 14e-3, 16: 20e-3}


def test_only_sequences_that_draw_exactly_per_position_speculate():
    assert exact_per_position(request([1], temperature=0.7, top_p=0.9, logprobs=3, logit_bias={3: 1.0}))
    for params in [dict(presence_penalty=0.5), dict(frequency_penalty=0.1), dict(repetition_penalty=1.2),
                   dict(min_tokens=4)]:
        assert not exact_per_position(request([1], **params))
    config = SpeculativeConfig("ngram", 2, disable_by_batch_size=3, adaptive_drafting=False)
    speculator = Speculator(config, NgramProposer(2, 1, 2), step_cost_model(DEVICE))
    looping = [running_request([1, 2, 1, 2, 1]) for _ in range(3)]
    speculator.prepare(looping[:2])
    assert speculator.wants_draws_first(looping[:2])
    speculator.propose(looping[:2], read_first=True)
    assert [r.draft_token_ids for r in looping[:2]] == [[2, 1], [2, 1]]
    for r in looping[:2]:
        r.draft_token_ids = []  # what the scheduler does with them
    speculator.prepare(looping)
    assert not speculator.wants_draws_first(looping)
    speculator.propose(looping, read_first=True)
    assert not any(r.draft_token_ids for r in looping) and speculator.outcomes == {"drafting": 1, "batch_size": 1}


def spec_step(drafts_per_seq: list[list[int]], params: SamplingParams) -> StepPlan:
    """Decode spans: each sequence's last known token, then its drafts."""
    seqs = []
    for slot, drafts in enumerate(drafts_per_seq):
        seq = ScheduledSeq.for_sequence(slot, [slot + 1], 3, [4 + slot] + drafts, params=params, seed=slot)
        seqs.append(dataclasses.replace(seq, num_draft_tokens=len(drafts), num_prompt_tokens=3, first_chunk=False,
                                        is_prefill=False))
    return StepPlan.of(seqs)


def test_the_builder_lays_out_a_draw_row_per_draft():
    layout = BatchLayout(tokens=8, seqs=3, max_pages=2, bias_entries=1, scratch_slot=3, max_drafts=2, head=DrawHead(2))
    assert layout.rows == 8 and layout.draws == 3
    ints, floats = BatchBuilder(3, 2, 4).build(spec_step([[7, 8], [], [9]], SamplingParams(temperature=0)), layout)
    b = layout.packing.views(ints, floats)
    np.testing.assert_array_equal(b.row_seq[:6], [0, 0, 0, 1, 2, 2])
    np.testing.assert_array_equal(b.row_pos, [0, 1, 2, 0, 0, 1, -1, -1])
    np.testing.assert_array_equal(b.row_index[:6], [0, 1, 2, 3, 4, 5])  # tokens: 4 7 8 | 5 | 6 9
    np.testing.assert_array_equal(b.row_draft, [7, 8, -1, -1, 9, -1, -1, -1])


def run_draw(step: StepPlan, logits: np.ndarray, counts: np.ndarray | None = None):
    """`draw` over fixed logits per token row ([tokens, VOCAB]) for a step of 3 sequences with up to 2 drafts."""
    layout = BatchLayout(tokens=8, seqs=3, max_pages=2, bias_entries=1, scratch_slot=3, max_drafts=2, head=DrawHead(2))
    ints, floats = BatchBuilder(3, 2, 4).build(step, layout)
    batch = layout.unpack(jnp.asarray(ints), jnp.asarray(floats))
    state = SamplerState(jnp.asarray(counts if counts is not None else np.zeros((4, VOCAB), np.int32)),
                         jnp.zeros((4, VOCAB), bool))
    masks = jnp.full((3, 1), -1, jnp.int32)
    hidden = jnp.asarray(np.pad(logits, ((0, 8 - len(logits)), (0, 0))), jnp.float32)
    draws, state = jax.jit(lambda h, b, s: draw(lambda x: x, h, b, s, masks, layout, 3, 2))(hidden, batch, state)
    return jax.tree.map(np.asarray, draws), np.asarray(state.output_counts)


def one_hot_logits(argmaxes: list[int]) -> np.ndarray:
    return np.stack([np.eye(VOCAB, dtype=np.float32)[t] * 10 for t in argmaxes])


def test_greedy_verification_keeps_the_longest_prefix_the_target_reproduces():
    step = spec_step([[7, 8], [], [9]], SamplingParams(temperature=0))
    # Rows: seq 0 reads tokens 0..2 and the target says 7 (matches), 3 (rejects 8), 11 (never reached);
    # seq 1 has no drafts; seq 2's draft 9 matches and the bonus draw is 12.
    counts = np.zeros((4, VOCAB), np.int32)
    counts[0, [7, 8]] = 1  # what record_tokens counted for slot 0's drafts
    draws, counts = run_draw(step, one_hot_logits([7, 3, 11, 10, 9, 12]), counts)
    np.testing.assert_array_equal(draws.accepted, [2, 1, 2])
    np.testing.assert_array_equal(draws.tokens[0, :2], [7, 3])
    np.testing.assert_array_equal(draws.last, [3, 10, 12])
    assert counts[0, 7] == 1 and counts[0, 8] == 0  # the rejected draft is uncounted


def test_a_step_without_drafts_draws_one_row_per_sequence():
    step = spec_step([[], [], []], SamplingParams(temperature=0))
    draws, _ = run_draw(step, one_hot_logits([3, 4, 5]))
    np.testing.assert_array_equal(draws.accepted, [1, 1, 1])
    np.testing.assert_array_equal(draws.last, [3, 4, 5])


def draws_at_own_keys(logits: np.ndarray, seeds: list[int], indexes: list[int]) -> list[int]:
    """What `sample()` draws from each row of logits at temperature 1 with the key of the token that row
    draws: its sequence's seed folded with the token's index among the outputs."""
    rows = len(logits)
    arrays = SamplingArrays(temperature=jnp.ones(rows), top_k=jnp.zeros(rows, jnp.int32), top_p=jnp.ones(rows),
                            min_p=jnp.zeros(rows), seed=jnp.asarray([seed_words(s) for s in seeds], jnp.uint32),
                            step=jnp.asarray(indexes, jnp.int32))
    return np.asarray(jax.jit(sample)(jnp.asarray(logits), arrays)).tolist()


def test_sampled_drafts_stand_exactly_while_the_draws_at_their_own_keys_reproduce_them():
    """Each draw row is drawn as a step without drafts would draw that token, with that token's own key, and a
    sampled draft stands only when that draw reproduces it: never because it is the target's favourite."""
    params = SamplingParams(temperature=1.0)
    # Spread rows (each most likely token has p < 0.25), from an rng seed that gives the draws below.
    logits = np.random.default_rng(6).normal(size=(6, VOCAB)).astype(np.float32)
    # Rows: seq 0 (seed 0) reads its token and two drafts, seq 1 (seed 1) none, seq 2 (seed 2) one.
    drawn = draws_at_own_keys(logits, seeds=[0, 0, 0, 1, 2, 2], indexes=[0, 1, 2, 0, 0, 1])
    want = [drawn[0:3], drawn[3:4], drawn[4:6]]  # per sequence
    favourite = logits.argmax(-1)
    # Seq 0: its first draft is its first draw (it stands); its second is the target's most likely token,
    # which its second draw is not (it is rejected, and that draw stands in its place).
    # Seq 2: its draft is its first draw while not the most likely token (it stands all the same).
    assert favourite[1] != want[0][1] and favourite[4] != want[2][0]
    drafts = [[want[0][0], int(favourite[1])], [], [want[2][0]]]
    spec, _ = run_draw(spec_step(drafts, params), logits)
    np.testing.assert_array_equal(spec.accepted, [2, 1, 2])
    for row, (accepted, draws) in enumerate(zip([2, 1, 2], want)):
        np.testing.assert_array_equal(spec.tokens[row, :accepted], draws[:accepted], err_msg=f"sequence {row}")
    np.testing.assert_array_equal(spec.last, [want[0][1], want[1][0], want[2][1]])
    # Without drafts, each sequence's one draw reads the same logits with the same key.
    plain, _ = run_draw(spec_step([[], [], []], params), logits[[0, 3, 4]])
    np.testing.assert_array_equal(plain.tokens[:, 0], [want[0][0], want[1][0], want[2][0]])


def test_acceptance_is_counted_per_draft_position():
    stats = EngineStats()
    stats.count_drafts(3, 2)
    stats.count_drafts(2, 0)
    assert (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens) == (2, 5, 2)
    assert stats.spec_accepted_per_pos == [1, 1, 0] and stats.spec_mean_accepted_length == 2.0


def test_each_sequence_verifies_the_drafts_its_acceptance_pays_for():
    """Two sequences drafting by prompt lookup on a model whose step holds two drafts at little cost and
    four at a third more: the one whose drafts keep standing verifies K every step, the one whose drafts
    never stand soon verifies none, and the log's counts say drafting was on."""
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=1)
    speculator = Speculator(config, NgramProposer(2, 1, 1), step_cost_model(DEVICE))
    for _ in range(4):  # plain steps at this width measured: 10 ms of device time and 0.5 of host
        speculator.cost.observe(10.5e-3, False, 2, 2)
    # Two loops, each token followed by the next: after t, prompt lookup drafts t + 1, t + 2. The target
    # goes on with the loop in the first and skips a token in the second, so none of its drafts stands.
    good, bad = running_request([*range(1, 10), 1]), running_request([*range(20, 30), 20])
    verified = {good.key: [], bad.key: []}
    for _ in range(12):
        speculator.prepare([good, bad])
        assert speculator.wants_draws_first([good, bad])
        speculator.propose([good, bad], read_first=True)
        for r in (good, bad):
            drafts, r.draft_token_ids = r.draft_token_ids, []
            verified[r.key].append(len(drafts))
            if r is good:
                r.token_ids += drafts + [(drafts or r.token_ids)[-1] % 9 + 1]
            else:
                r.token_ids.append(((drafts or r.token_ids[-1:])[0] - 19) % 10 + 20)
            r.num_computed = len(r.token_ids) - 1
    assert verified[good.key][-6:] == [2] * 6
    assert verified[bad.key][0] > 0 and verified[bad.key][-6:] == [0] * 6  # it drafted until it measured
    assert speculator.outcomes["drafting"] == 12
    good_gains, bad_gains = speculator.acceptance.gains(good.key), speculator.acceptance.gains(bad.key)
    assert good_gains[1] > 0.8 and bad_gains[0] < good_gains[0] - 0.3


def test_a_drafting_steps_periods_and_the_drafts_that_stood_are_booked_in_the_guards_ledger(monkeypatch):
    """The realized side of `ledger.py`, as the speculator books it: each drafting step's own period and the
    next one (which waits for it) at what they took over a plain step, and the drafts that stood; a plain
    step's period is not booked. One sequence drafts on six steps, then its text stops repeating: the next
    step was planned to draft on the guess that it would go on, reads first, finds nothing, and is booked
    too (charged what the guess expected, realized nothing but its time)."""
    clock = [0.0]
    monkeypatch.setattr(speculator_module, "time",
                        type("Clock", (), {"perf_counter": lambda: clock[0], "monotonic": lambda: clock[0]}))
    monkeypatch.setattr(ledger, "MEMORY_STEPS", 10**9)  # plain sums, for the arithmetic below
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=1)
    speculator = Speculator(config, NgramProposer(2, 1, 1), step_cost_model(DEVICE))
    for _ in range(4):  # plain steps at one sequence: 10 ms of device time and 0.5 of host
        speculator.cost.observe(10.5e-3, False, 1, 1)
    r = running_request([*range(1, 10), 1])  # a loop: after t, prompt lookup drafts t + 1, t + 2

    def engine_step(read_first: bool, period: float) -> list[int]:
        drafting = speculator.wants_draws_first([r])
        speculator.propose([r], read_first=read_first or drafting)
        drafts, r.draft_token_ids = r.draft_token_ids, []
        speculator.observe(FakeLaunched(FakePlan(1 + len(drafts), bool(drafts))), [r])
        speculator.prepare([r])
        clock[0] += period
        speculator.record_step(1, read_first or drafting)
        return drafts

    speculator.prepare([r])
    for _ in range(6):
        drafts = engine_step(False, 20e-3)
        assert len(drafts) == 2
        r.token_ids += drafts + [drafts[-1] % 9 + 1]  # both stand, and the target goes on with the loop
        r.num_computed = len(r.token_ids) - 1
    r.token_ids += [50, 51]  # new text: nothing to draft
    r.num_computed = len(r.token_ids) - 1
    assert engine_step(True, 20e-3) == []  # planned on the guess; waits for the last verifying step
    assert speculator.outcomes["unprofitable"] + speculator.outcomes["no_drafts"] == 1
    assert engine_step(False, 13e-3) == []  # a plain step: not booked
    book = speculator.payoff.ledger._books[1]
    assert book.steps == pytest.approx(7)
    # Six periods booked (the first step's own is not measured: no period before it), 9.5 ms each over the
    # plain step's 10.5; the plain step's 2.5 ms over it is not.
    assert book.seconds == pytest.approx(6 * 9.5e-3)
    assert book.tokens == pytest.approx(12)  # two drafts stood on each of the six steps


class CountingSpeculator(Speculator):
    """The speculator, counting its decisions (each weighs every sequence's expected drafts)."""
    decisions = 0

    def _decide(self, running, hopeful):
        self.decisions += 1
        return super()._decide(running, hopeful)


@pytest.mark.parametrize("jitter", [False, True])
def test_a_full_batch_jittering_by_one_sequence_is_not_decided_again_each_step(jitter):
    """16 sequences whose text never repeats (nothing to draft), one of which is missing on every other step
    as a finished one's slot waits to be refilled: 15 running falls in the width class below 16's, and the
    decision must not be made again on each such step."""
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=2)
    speculator = CountingSpeculator(config, NgramProposer(2, 2, 2),
                                    step_cost_model({4: 1e-3, 8: 1e-3, 16: 1.2e-3, 32: 2e-3}))
    full = [running_request(range(100 * s, 100 * s + 20)) for s in range(16)]
    launched = FakeLaunched(FakePlan(16, False))
    for step in range(200):
        running = full[:15] if jitter and step % 2 else full
        speculator.wants_draws_first(running)
        speculator.propose(running, read_first=False)
        speculator.observe(launched, running)
        speculator.prepare(running)
        speculator.record_step(len(running), read_first=False)
        for r in running:
            r.token_ids.append(r.token_ids[-1] + 1)  # never an earlier n-gram
            r.num_computed += 1
    assert speculator.outcomes["no_drafts"] + speculator.outcomes["measuring"] == 200
    assert speculator.decisions < 200 // 4  # every step while unmeasured, then at the priced interval


class CountingCallsSpeculator(Speculator):
    """The speculator, counting the steps it proposed for and the guesses it prepared."""
    proposed = prepared = 0

    def propose(self, running, read_first):
        self.proposed += 1
        super().propose(running, read_first)

    def prepare(self, running):
        self.prepared += 1
        super().prepare(running)


def engine_step(speculator: Speculator, running, tokens: int, read_first: bool = False) -> None:
    """One `Engine.step` as the speculator sees it: `read_first`, whether the engine read the step in flight
    first for its own reasons (a prefill-only step, a constrained sequence)."""
    read_first = speculator.wants_draws_first(running) or read_first
    launched = FakeLaunched(FakePlan(tokens, False))
    if read_first or not speculator.standing_by:
        speculator.propose(running, read_first)
        speculator.observe(launched, running)
    speculator.after_step(running, read_first, launched, EngineStats())


def test_a_speculator_standing_by_counts_and_times_each_step_without_proposing():
    """16 sequences whose text never repeats: once plain steps are measured, drafting stays off and the
    speculator stands by between its priced decisions. Those steps skip propose, observe and prepare (the
    host work an engine that does not draft pays over one without speculation) and still count: outcomes,
    acceptance's clock, and the cost model's periods, one in STANDBY_SAMPLE_PERIODS priced. A step the
    engine read first anyway proposes: its tokens are known for free."""
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=2)
    speculator = CountingCallsSpeculator(config, NgramProposer(2, 2, 2),
                                         step_cost_model({4: 1e-3, 8: 1e-3, 16: 1.2e-3, 32: 2e-3}))
    running = [running_request(range(100 * s, 100 * s + 20)) for s in range(16)]
    standing = 0
    for _ in range(300):
        engine_step(speculator, running, 16)
        standing += speculator.standing_by
        for r in running:
            r.token_ids.append(r.token_ids[-1] + 1)  # never an earlier n-gram
            r.num_computed += 1
    assert sum(speculator.outcomes.values()) == speculator.proposals == speculator.acceptance.steps == 300
    assert speculator.proposed + standing == 300 and standing > 200
    assert speculator.prepared == speculator.proposed  # guesses only for the decisions
    assert speculator.cost.periods == 299 and speculator.cost.measured(16)
    priced = sum(a.count for a in speculator.cost._residual.values())
    assert priced < 299 - standing // 2  # standing by, three periods in four are not priced
    assert speculator.outcomes["no_drafts"] + speculator.outcomes["measuring"] == 300

    while not speculator.standing_by:  # until a step stands by
        engine_step(speculator, running, 16)
    proposed = speculator.proposed
    engine_step(speculator, running, 16, read_first=True)
    assert speculator.proposed == proposed + 1 and not speculator.standing_by


def test_standing_by_the_probe_budget_still_grows_with_the_time_served(monkeypatch):
    """Standing by, only one period in STANDBY_SAMPLE_PERIODS is timed; it stands for the untimed ones before
    it in the probes' budget, so the seconds the payoff was told it served still follow the clock. A fake
    clock: each step takes 1 ms, each reading of it 10 us more."""
    class Clock:
        now = 0.0

        def perf_counter(self):
            self.now += 1e-5
            return self.now

        monotonic = perf_counter

    clock = Clock()
    monkeypatch.setattr(speculator_module, "time", clock)
    config = SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=2)
    speculator = Speculator(config, NgramProposer(2, 2, 2), step_cost_model({4: 1e-3, 8: 1e-3, 16: 1.2e-3}))
    running = [running_request(range(100 * s, 100 * s + 20)) for s in range(4)]
    standing, start = 0, None
    for step in range(400):
        if step == 100:  # measured by now
            start, served = clock.now, speculator.payoff.served_seconds
        engine_step(speculator, running, 4)
        standing += step >= 100 and speculator.standing_by
        clock.now += 1e-3
        for r in running:
            r.token_ids.append(r.token_ids[-1] + 1)  # never an earlier n-gram
            r.num_computed += 1
    assert standing > 200  # of the last 300 steps
    assert speculator.payoff.served_seconds - served == pytest.approx(clock.now - start, rel=0.05)
