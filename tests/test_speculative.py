"""Speculative decoding on stories260K, against the same engine without it: greedy and seeded outputs
token for token, a sampled distribution by a chi-square test, no compilation after warm-up, no leaks."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.speculative.payoff import OUTCOMES
from tests.page_checks import assert_pages_released

# Drafting on every step (no pricing of each step), so each test meets drafts whatever this machine measures.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive_drafting": False}
SHAPES = dict(max_num_seqs=8, max_num_batched_tokens=32, token_buckets=(8, 32))

# Prompts whose continuations reuse spans of them (n-gram drafts get accepted), and ones that do not.
PROMPTS = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom went to the",
           "The cat sat on the mat. The cat sat on the", "Tim had a red ball. Tim liked his red ball. Tim",
           "One day, a little bird", "She said, \"I am happy!\" He said, \"I am"]


@pytest.fixture(scope="module")
def plain(stories_dir):
    return LLM(str(stories_dir), **SHAPES)


@pytest.fixture(scope="module")
def speculative(stories_dir):
    return LLM(str(stories_dir), speculative_config=SPEC, **SHAPES)


def truncated_draft(stories_dir: Path, out: Path, layers: int) -> Path:
    """stories260K cut to its first `layers` layers (embeddings, norm and head kept): a draft model with the
    target's vocabulary that disagrees with it often."""
    tensors = {name: t for name, t in load_file(stories_dir / "model.safetensors").items()
               if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers}
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((stories_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return out


@pytest.fixture(scope="module")
def draft_dir(stories_dir, tmp_path_factory):
    return truncated_draft(stories_dir, tmp_path_factory.mktemp("draft") / "stories-3-layers", 3)


@pytest.fixture(scope="module")
def drafted(stories_dir, draft_dir):
    return LLM(str(stories_dir), speculative_config={"method": "draft_model", "model": str(draft_dir),
                                                     "num_speculative_tokens": 3, "adaptive_drafting": False},
               **SHAPES)


def ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_greedy_story_and_prompts_are_token_identical(plain, speculative, story_text):
    greedy = SamplingParams(temperature=0, max_tokens=80)
    story = speculative.generate([[1]], SamplingParams(temperature=0, max_tokens=60))[0].outputs[0].text
    assert story.strip().startswith(story_text[:120])
    before = speculative.engine.stats.spec_accepted_tokens
    assert ids(speculative.generate(PROMPTS, greedy)) == ids(plain.generate(PROMPTS, greedy))
    assert speculative.engine.stats.spec_accepted_tokens > before  # drafts were verified and some stood


def mixed_workload(tokenizer, count: int):
    rng = random.Random(5)
    story_ids = tokenizer.encode(" ".join(PROMPTS))
    prompts, params = [], []
    for i in range(count):
        start = rng.randrange(len(story_ids) - 2)
        prompts.append([1] + story_ids[start:start + rng.randint(1, 40)])
        extra = rng.choice([{}, {}, {"logprobs": 3}, {"n": 2}, {"stop": ["."]}, {"presence_penalty": 0.5},
                            {"min_tokens": 5}, {"logit_bias": {13: 3.0}}, {"top_k": 20, "top_p": 0.9}])
        temperature = rng.choice([0, 0, 0.8])
        params.append(SamplingParams(temperature=temperature, seed=i if temperature else None,
                                     max_tokens=rng.randint(extra.get("min_tokens", 1), 40), **extra))
    return prompts, params


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_mixed_workload_gives_the_same_tokens_compiles_nothing_and_leaks_nothing(method, request, plain):
    """Greedy and seeded requests of every length, with logprobs, n > 1, stop strings, penalties (which do
    not speculate), min_tokens and logit_bias, all in one batch: identical outputs either way."""
    speculative = request.getfixturevalue("speculative" if method == "ngram" else "drafted")
    prompts, params = mixed_workload(plain.get_tokenizer(), 200)
    got, want = speculative.generate(prompts, params), plain.generate(prompts, params)
    assert ids(got) == ids(want)
    for g, w in zip(got, want):
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        for gc, wc in zip(g.outputs, w.outputs):
            if wc.logprobs is not None:  # the target's logprobs of each accepted token, at its own position
                np.testing.assert_allclose([e[t].logprob for e, t in zip(gc.logprobs, gc.token_ids)],
                                           [e[t].logprob for e, t in zip(wc.logprobs, wc.token_ids)], atol=1e-4)
    engine = speculative.engine
    assert engine.compilations_since_warmup == 0
    assert_pages_released(engine.scheduler)
    stats = engine.stats
    assert stats.spec_drafts > 0 and 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    per_pos = stats.spec_accepted_per_pos
    assert len(per_pos) == engine.speculator.num_speculative_tokens and per_pos == sorted(per_pos, reverse=True)


def test_steps_that_verify_no_drafts_run_the_plain_program_of_their_bucket(speculative, plain, monkeypatch):
    """An n-gram engine compiles two programs a bucket: one that verifies drafts and, for the steps that
    verify none, exactly the program of an engine without speculation (no draft rows, no branch on them);
    each step runs the one it needs, and nothing compiles after warm-up."""
    runner = speculative.engine.runner
    assert runner.compiler.plain_layouts == plain.engine.runner.layouts
    assert runner.warmup_report.programs == 2 * len(runner.layouts)
    ran = []
    launch = runner.launch

    def recording(step, *args, **kwargs):
        launched = launch(step, *args, **kwargs)
        ran.append((step.verifies_drafts, launched.layout.max_drafts))
        return launched

    monkeypatch.setattr(runner, "launch", recording)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=48, ignore_eos=True)
              for i in range(len(PROMPTS))]  # greedy and seeded
    assert ids(speculative.generate(PROMPTS, params)) == ids(plain.generate(PROMPTS, params))
    assert {(True, SPEC["num_speculative_tokens"]), (False, 0)} == set(ran)
    assert speculative.engine.compilations_since_warmup == 0


def test_preemption_with_drafts_in_flight_gives_the_same_tokens(stories_dir, plain):
    """Too few KV pages for every running sequence: the newest are preempted (drafts and all) and
    recomputed later, and every output is still what the engine without speculation gives."""
    # Its own KV pool is its own programs: one bucket (32) keeps them to two, plain and verifying (preemption
    # is the scheduler's; both buckets' programs are the `speculative` engine's tests).
    tight = LLM(str(stories_dir), speculative_config=SPEC, num_pages=24, max_model_len=128,
                **dict(SHAPES, token_buckets=(32,)))
    prompts, _ = mixed_workload(plain.get_tokenizer(), 16)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=60, ignore_eos=True) for i in range(16)]
    assert ids(tight.generate(prompts, params)) == ids(plain.generate(prompts, params))
    engine = tight.engine
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_accepted_tokens > 0
    assert engine.compilations_since_warmup == 0
    assert_pages_released(engine.scheduler)


def test_sequences_that_cannot_verify_exactly_propose_nothing(speculative):
    engine = speculative.engine
    before = engine.stats.spec_drafts
    prompt = "Lily and Tom went to the park. Lily and Tom went to the"
    speculative.generate([prompt], SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3))
    assert engine.stats.spec_drafts == before


def chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Pearson's statistic for two equal-size samples over the tokens both drew (bins under 5 pooled)."""
    bins, pooled = [], [0, 0]
    for token in set(a) | set(b):
        if a[token] + b[token] >= 10:
            bins.append((a[token], b[token]))
        else:
            pooled[0] += a[token]
            pooled[1] += b[token]
    bins.append(tuple(pooled))
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins if x + y)
    return stat, len(bins) - 1


def test_sampled_tokens_keep_the_target_distribution(plain, drafted):
    """The token drawn where a draft was verified, over many seeds, against the same position without
    speculation under other seeds: a two-sample chi-square test.

    The position is chosen so that a biased acceptance rule shows: after "The dog" the second token is
    spread (its most likely, " a", has p ~ 0.24) while the 3-layer draft proposes that most likely token in
    ~60% of sequences. Accepting drafts that match the target's argmax instead of its seeded draw puts ~0.55
    on " a": at these seeds a statistic of 174 against the bound 33 (12 degrees of freedom), and ~1e-11
    odds of passing at 400 samples; the right rule gives 24 against 42 (18; p = 0.15). It still rejects
    about three drafts in four, so the draws that replace rejected drafts are tested too."""
    engine = drafted.engine
    before = (engine.stats.spec_draft_tokens, engine.stats.spec_accepted_tokens)
    n, position = 400, 1
    prompt = "The dog"

    def histogram(llm, first_seed):
        # One token past `position`: the scheduler verifies a draft there (the last token is the bonus draw).
        params = [SamplingParams(temperature=1.0, seed=first_seed + i, max_tokens=position + 2, ignore_eos=True)
                  for i in range(n)]
        return Counter(o.outputs[0].token_ids[position] for o in llm.generate([prompt] * n, params))

    with_drafts, without = histogram(drafted, 10_000), histogram(plain, 0)
    drafted_tokens = engine.stats.spec_draft_tokens - before[0]
    accepted = engine.stats.spec_accepted_tokens - before[1]
    assert drafted_tokens == n  # every sequence drew `position` by verifying a draft
    stat, dof = chi_square_two_sample(with_drafts, without)
    # The 99.9% quantile of chi-square(dof), by Wilson and Hilferty's approximation.
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 5 and stat < bound, (stat, dof, bound, with_drafts.most_common(3), without.most_common(3))
    assert 0 < accepted < drafted_tokens / 2  # it disagreed often, and agreed sometimes


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adaptive_drafting_prices_each_step_and_keeps_the_tokens(method, stories_dir, draft_dir, plain):
    """The default: each step drafts or not by its price (`jaxserve/speculative/payoff.py`, whose decisions
    are tested with a scripted machine in tests/test_drafting_payoff.py). Whatever it chooses, greedy and
    seeded tokens are plain decoding's, nothing compiles after warm-up (a draft model's following-only programs were
    compiled at warm-up too), nothing leaks, and every step's outcome is counted."""
    spec = ({k: v for k, v in SPEC.items() if k != "adaptive_drafting"} if method == "ngram" else
            {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    adaptive = LLM(str(stories_dir), speculative_config=spec, **SHAPES)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=160, ignore_eos=True)
              for i in range(len(PROMPTS))]  # greedy and seeded
    assert ids(adaptive.generate(PROMPTS, params)) == ids(plain.generate(PROMPTS, params))
    engine = adaptive.engine
    speculator = engine.speculator
    assert set(speculator.outcomes) <= set(OUTCOMES) and 0 < sum(speculator.outcomes.values()) <= engine.step_count
    assert speculator.cost.measured(len(PROMPTS))  # six sequences: plain steps at width 4+ were timed
    assert engine.compilations_since_warmup == 0
    assert_pages_released(engine.scheduler)
