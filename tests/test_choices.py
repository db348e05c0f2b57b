"""n choices per request: distinct, reproducible per seed (alone or in a busy batch), and the prompt is
prefilled once — the other choices start from choice 0's prompt pages."""

from __future__ import annotations

import random

import pytest

from jaxserve import SamplingParams


def unique_prompt(seed: int, length: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 500) for _ in range(length - 1)]


def choices(output) -> list[list[int]]:
    assert [o.index for o in output.outputs] == list(range(len(output.outputs)))
    return [o.token_ids for o in output.outputs]


def test_four_seeded_choices_are_distinct_reproducible_and_share_one_prefill(stories_llm):
    engine = stories_llm.engine
    prompt = unique_prompt(1)
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=12, n=4)
    before = engine.stats.prompt_tokens
    first = choices(stories_llm.generate([prompt], params)[0])
    prefilled = engine.stats.prompt_tokens - before
    # Page size 16: the 2 whole pages before the last prompt token are shared; each other choice computes
    # the remaining 8 prompt tokens itself (and samples its own first token from their last).
    assert prefilled == 40 + 3 * (40 - 32)
    assert len({tuple(c) for c in first}) == 4 and all(len(c) == 12 for c in first)
    assert choices(stories_llm.generate([prompt], params)[0]) == first  # a rerun
    busy = stories_llm.generate([unique_prompt(2), prompt, unique_prompt(3)],
                                [SamplingParams(temperature=1.0, seed=5, max_tokens=20, n=3), params,
                                 SamplingParams(temperature=0, max_tokens=7)])
    assert choices(busy[1]) == first  # inside a busy batch
    assert len(busy[0].outputs) == 3 and len(busy[2].outputs) == 1


def test_choice_j_draws_with_seed_plus_j(stories_llm):
    prompt = unique_prompt(4)
    together = choices(stories_llm.generate([prompt], SamplingParams(temperature=1.0, seed=40, max_tokens=8, n=3))[0])
    alone = [stories_llm.generate([prompt], SamplingParams(temperature=1.0, seed=40 + j, max_tokens=8))[0]
             .outputs[0].token_ids for j in range(3)]
    assert together == alone


def test_greedy_choices_agree_and_logprobs_come_per_choice(stories_llm):
    out = stories_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=6, n=2, logprobs=2))
    a, b = out[0].outputs
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 6
    # Equal to rounding, not bit for bit: the two choices prefill in different rows of one step, and the
    # blocked attention's query windows split those rows differently (summation order). A float32 logit
    # near 10 has an ulp of ~1e-6, and six log-softmaxes add up: CI saw 1.4e-6 apart, so allow 1e-5.
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-5) and a.cumulative_logprob < 0


def test_aborting_a_request_aborts_every_choice(stories_llm):
    engine = stories_llm.engine
    request_id = engine.add_request(unique_prompt(6), SamplingParams(temperature=1.0, max_tokens=200, n=3,
                                                                      ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort(request_id)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.index] = out.finish_reason
    assert finished == {0: "abort", 1: "abort", 2: "abort"}
    scheduler = engine.scheduler
    assert not scheduler.running and not scheduler.waiting and scheduler.allocator.num_in_use == 0
