"""The public research API: hand-driven steps agree with the engine, pages and scores are what they claim."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.research import Workbench


@pytest.fixture(scope="module")
def bench(stories_llm):
    return Workbench(stories_llm)


def test_prefill_then_decode_by_hand_gives_the_engine_s_tokens(bench):
    prompt = bench.tokenizer.encode("Once upon a time")
    seq = bench.new_sequence(32)
    try:
        tokens = [bench.step([(seq, prompt)]).next_tokens[0]]
        for _ in range(7):
            tokens.append(bench.step([(seq, [tokens[-1]])]).next_tokens[0])
        assert seq.length == len(prompt) + 7
    finally:
        bench.release(seq)
    expected = bench.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    assert tokens == list(expected)


def test_kv_reads_back_what_the_step_wrote_and_page_map_counts_tokens(bench):
    seq = bench.new_sequence(bench.page_size + 3)
    try:
        bench.step([(seq, bench.tokenizer.encode("Tom and his dog went to the park to play"))])
        k, v = bench.kv(seq, layer=0)
        config = bench.model_config
        assert k.shape == v.shape == (seq.length, config.num_kv_heads, config.head_dim)
        assert np.abs(k).sum(axis=(1, 2)).min() > 0  # every position was written
        assert sum(n for _, n in bench.page_map(seq)) == seq.length
        assert [p for p, _ in bench.page_map(seq)] == seq.pages
    finally:
        bench.release(seq)


def test_score_matches_the_engine_s_prompt_logprobs(bench):
    scores = bench.score("Once upon a time, there was a little girl named Lily.")
    out = bench.llm.generate([scores.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    engine = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], scores.token_ids[1:])]
    np.testing.assert_allclose(engine, scores.logprobs, atol=1e-4)
    assert scores.perplexity == pytest.approx(np.exp(-np.mean(engine)), rel=1e-4)
    assert len(scores.tokens) == len(scores.token_ids) == len(scores.logprobs) + 1


def test_scoring_a_text_longer_than_one_step_uses_several(bench):
    text = " ".join(["The little dog ran to the park."] * 12)
    scores = bench.score(text)
    assert len(scores.token_ids) > bench.max_step_tokens and np.isfinite(scores.logprobs).all()


def test_sequences_give_their_pages_back_and_overflows_are_refused(bench):
    free = bench.allocator.num_free
    seq = bench.new_sequence(8)
    with pytest.raises(ValueError, match="do not fit"):
        bench.step([(seq, list(range(3, 3 + seq.capacity + 1)))])
    bench.release(seq)
    assert bench.allocator.num_free == free
