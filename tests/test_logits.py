"""Penalties, biases and masks of the step (`jaxserve/sampling/logits.py`) against a numpy reference, and their effect
on greedy output end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.sampling.logits import LogitsParams, SamplerState, process, record_tokens
from jaxserve.sampling.params import ADD_BIAS, ALLOWED

VOCAB, SLOTS, B = 40, 4, 6


def reference(logits, counts, in_prompt, presence, frequency, repetition, bias, allowed):
    """vLLM's order: repetition over prompt + output, then frequency and presence over output, then biases;
    allowed_token_ids masks the rest."""
    out = logits.astype(np.float64).copy()
    for r in range(len(out)):
        seen = (counts[r] > 0) | in_prompt[r]
        out[r, seen] = np.where(out[r, seen] > 0, out[r, seen] / repetition[r], out[r, seen] * repetition[r])
        out[r] -= frequency[r] * counts[r] + presence[r] * (counts[r] > 0)
        for token, value in bias[r].items():
            out[r, token] += value
        if allowed[r] is not None:
            mask = np.ones(VOCAB, bool)
            mask[allowed[r]] = False
            out[r, mask] = -np.inf
    return out


def test_record_tokens_counts_outputs_marks_prompts_and_clears_fresh_slots():
    state = SamplerState(jnp.ones((SLOTS + 1, VOCAB), jnp.int32), jnp.zeros((SLOTS + 1, VOCAB), jnp.bool_))
    slots = jnp.array([2, 0, SLOTS])  # the third row is padding (scratch slot)
    fresh = jnp.array([1, 0, 0])
    token_slot = jnp.array([2, 2, 2, 0, 0, SLOTS])
    tokens = jnp.array([5, 5, 7, 5, 9, 3])
    kinds = jnp.array([1, 2, 2, 2, 2, 0])  # a prompt token, then outputs; the last token is padding
    new = record_tokens(state, slots, fresh, token_slot, tokens, kinds)
    counts, prompt = np.asarray(new.output_counts), np.asarray(new.in_prompt)
    expect = np.ones((SLOTS + 1, VOCAB), np.int32)
    expect[2] = 0  # fresh: cleared first
    expect[2, 5] += 1
    expect[2, 7] += 1
    expect[0, 5] += 1
    expect[0, 9] += 1
    expect[SLOTS] = 0  # the scratch row ends clean
    np.testing.assert_array_equal(counts, expect)
    assert prompt[2, 5] and prompt.sum() == 1


def test_process_matches_the_numpy_reference():
    rng = np.random.default_rng(0)
    rows = 3
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (SLOTS + 1, VOCAB)).astype(np.int32) * (rng.random((SLOTS + 1, VOCAB)) < 0.3)
    in_prompt = rng.random((SLOTS + 1, VOCAB)) < 0.2
    slots = np.array([1, 3, 0])
    presence, frequency, repetition = np.array([0.5, 0.0, -1.0]), np.array([0.2, 1.5, 0.0]), np.array([1.3, 1.0, 0.7])
    bias = [{3: -100.0, 8: 5.5}, {}, {11: 2.0}]
    allowed = [None, [2, 4, 6], [11, 12]]
    ids, values, kinds = np.zeros((rows, B), np.int32), np.zeros((rows, B), np.float32), np.zeros((rows, B), np.int32)
    for r in range(rows):
        entries = {t: [v, ADD_BIAS] for t, v in bias[r].items()}
        for t in allowed[r] or []:
            entries.setdefault(t, [0.0, 0])[1] |= ALLOWED
        for j, (t, (v, k)) in enumerate(entries.items()):
            ids[r, j], values[r, j], kinds[r, j] = t, v, k
    params = LogitsParams(presence=jnp.asarray(presence, jnp.float32), frequency=jnp.asarray(frequency, jnp.float32),
                          repetition=jnp.asarray(repetition, jnp.float32), bias_ids=jnp.asarray(ids),
                          bias_values=jnp.asarray(values), bias_kinds=jnp.asarray(kinds),
                          restrict=jnp.asarray([a is not None for a in allowed], jnp.int32), active=jnp.int32(1))
    state = SamplerState(jnp.asarray(counts), jnp.asarray(in_prompt))
    got = np.asarray(jax.jit(process)(jnp.asarray(logits), state, jnp.asarray(slots), params))
    want = reference(logits, counts[slots], in_prompt[slots], presence, frequency, repetition, bias, allowed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Inactive: untouched, whatever the rows say.
    idle = jax.jit(process)(jnp.asarray(logits), state, jnp.asarray(slots),
                            params.__class__(**{**params.__dict__, "active": jnp.int32(0)}))
    np.testing.assert_array_equal(np.asarray(idle), logits)


GREEDY = dict(temperature=0, max_tokens=60)


def test_a_minus_100_bias_removes_the_token(stories_llm):
    base = stories_llm.generate(["Once upon a time"], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    banned = base[3]
    biased = stories_llm.generate(["Once upon a time"], SamplingParams(**GREEDY, logit_bias={banned: -100}))
    out = biased[0].outputs[0].token_ids
    assert banned not in out and out[:3] == base[:3]
    favoured = stories_llm.generate(["Once upon a time"], SamplingParams(**GREEDY, logit_bias={7: 100}))
    assert set(favoured[0].outputs[0].token_ids) == {7}


def test_a_strong_repetition_penalty_removes_repeats(stories_llm):
    prompt = "Once upon a time"
    base = stories_llm.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    assert len(set(base)) < len(base)  # the plain story repeats tokens
    prompt_ids = stories_llm.get_tokenizer().encode(prompt)
    out = stories_llm.generate([prompt], SamplingParams(**GREEDY, repetition_penalty=100.0))[0].outputs[0].token_ids
    assert len(set(out)) == len(out) and not set(out) & set(prompt_ids[1:])
    # Frequency and presence penalties (the most OpenAI allows) cut repeats down, though not to none.
    out = stories_llm.generate([prompt], SamplingParams(**GREEDY, frequency_penalty=2.0, presence_penalty=2.0))
    repeats = lambda ids: len(ids) - len(set(ids))
    assert repeats(out[0].outputs[0].token_ids) < repeats(base) / 2


def test_min_tokens_masks_eos_and_stop_tokens(stories_llm):
    # From BOS the story ends (EOS id 1 or 2) after about 45 tokens; stop token 261 comes up early.
    short = stories_llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[261]))
    first_stop = len(short[0].outputs[0].token_ids)
    assert short[0].outputs[0].finish_reason == "stop" and first_stop < 20
    longer = stories_llm.generate([[1]], SamplingParams(temperature=0, max_tokens=200, stop_token_ids=[261],
                                                        min_tokens=30))
    out = longer[0].outputs[0].token_ids
    assert len(out) >= 30 and 261 not in out[:29] and 1 not in out[:29] and 2 not in out[:29]


def test_allowed_token_ids_restrict_the_draw(stories_llm):
    allowed = [286, 298, 376]
    out = stories_llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                                                   allowed_token_ids=allowed))
    assert set(out[0].outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize("kw, param", [({"repetition_penalty": 0}, "repetition_penalty"),
                                       ({"repetition_penalty": -1}, "repetition_penalty"),
                                       ({"min_tokens": -5}, "min_tokens"),
                                       ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
                                       ({"presence_penalty": 2.5}, "presence_penalty"),
                                       ({"logit_bias": {5: 101}}, "logit_bias"),
                                       ({"logprobs": -1}, "logprobs"), ({"n": 0}, "n")])
def test_bad_settings_name_the_parameter(kw, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


@pytest.mark.parametrize("kw, param", [({"logit_bias": {512: 1.0}}, "logit_bias"),
                                       ({"allowed_token_ids": [600]}, "allowed_token_ids"),
                                       ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": 50}, "prompt_logprobs"),
                                       ({"logit_bias": {i: 1.0 for i in range(200)}}, "logit_bias"),
                                       ({"n": 9}, "n")])
def test_limits_that_depend_on_the_engine(stories_llm, kw, param):
    with pytest.raises(ValueError) as e:
        stories_llm.engine.validate([1, 2], SamplingParams(**kw))
    assert e.value.param == param
