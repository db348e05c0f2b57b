"""The warm-up batches (`BatchBuilder.warmup`, `ModelRunner.run_warmup_batches`): each program's loops and
branches entered once before the first request, and nothing a request owns touched by them.

Why they exist (a one-off cost, measured in benchmarks/first_wave.py, not here): XLA:CPU pays it the first
time a program enters a loop or a branch, and an idle step enters neither."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import step_timing
from jaxserve.scheduling.pages import NULL_PAGE
from jaxserve.scheduling.step_cost import StepCostModel

# n-gram speculation so that the programs verify drafts and the draft branch is among those entered.
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
        "adaptive_drafting": False}


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(1, 8, 32),
               speculative_config=SPEC)


def views(runner, layout, every_option, verify=False):
    return layout.packing.views(*runner.builder.warmup(layout, every_option, verify))


@pytest.mark.parametrize("every_option, verify", [(False, False), (True, False), (False, True)])
def test_warmup_batches_fill_their_bucket_with_sequences_on_the_null_page(llm, every_option, verify):
    """The two warm-up batches, and the verify batch that times a step's draft rows (greedy sequences of
    a draft and the token after it)."""
    runner = llm.engine.runner
    for layout in runner.layouts.values():
        b = views(runner, layout, every_option, verify)
        n = int(np.count_nonzero(b.kv_lens))
        drafts = (every_option or verify) and layout.tokens > 1  # a one-token bucket has no room for a draft
        assert n == (min(layout.seqs, layout.tokens // 2) if drafts else 1 if every_option
                     else min(layout.seqs, layout.tokens))
        assert b.cu_q_lens[n] == b.cu_q_lens[-1] == layout.tokens  # no padding token: every one attends
        lens = b.kv_lens[:n]
        assert np.all(np.diff(b.cu_q_lens[:n + 1]) == lens)  # each sequence's keys are its tokens
        # Between them the two batches enter the decode rows' loop (one-token sequences) and a prefill
        # chunk's (a longer one) of every bucket that can hold either.
        if not (every_option or verify):
            assert lens.min() == 1 and lens.max() == max(1, layout.tokens - layout.seqs + 1)
        elif layout.tokens > 1:
            assert lens.max() >= 2
        assert np.all(b.write_index // runner.builder.page_size == NULL_PAGE)
        assert np.all(b.page_tables == NULL_PAGE) and np.all(b.slots == layout.scratch_slot)
        assert np.all(b.token_kind == 1) and np.all(b.fresh[:n] == 1)
        draws = b.row_pos >= 0
        ends = b.cu_q_lens[1:n + 1][b.row_seq[draws]]
        assert np.all((b.row_index[draws] < ends) & (b.row_index[draws] >= ends - 2))  # its own last tokens
        options = [b.sampling.temperature[:n] > 0, b.sampling.top_k[:n] > 0, b.sampling.top_p[:n] < 1,
                   b.processing.active > 0, b.constrained > 0, b.logprobs[:n] >= 0]
        assert all(np.all(o) == every_option for o in options)
        assert layout.max_drafts and np.any(b.row_draft >= 0) == drafts


def snapshot(engine):
    """The KV cache without its null pages, and the sampler state without its scratch row, on the host."""
    runner, pages = engine.runner, engine.scheduler.allocator.num_pages
    # Every K and V array, per layer or folded ([KVH, L * P, ...]: a null page every P pages).
    kv = [np.delete(np.asarray(a), np.arange(NULL_PAGE, a.shape[1], pages), axis=1)
          for a in jax.tree.leaves(runner.kv_cache)]
    state = [np.asarray(x)[:-1] for x in jax.tree.leaves(runner.sampler_state)]
    return kv, state


def test_warmup_batches_leave_what_requests_own_as_it_was(llm):
    """Nor does the verify step calibration times (`StepTiming._time_verify_step`)."""
    engine = llm.engine
    prompt = "Once upon a time, Lily and Tom went to the park. Lily and Tom"
    params = [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=12, temperature=0.8, seed=7,
                                                                           presence_penalty=0.5)]
    before = [o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params)]
    kv, state = snapshot(engine)
    for bucket in engine.runner.layouts:
        engine.runner.run_warmup_batches(bucket)
        engine.runner.time_idle_step(bucket, verify=True)
    kv_after, state_after = snapshot(engine)
    for a, b in zip(kv + state, kv_after + state_after):
        np.testing.assert_array_equal(a, b)
    # The prompt's cached pages are read again (a prefix-cache hit) and give the same tokens.
    assert [o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params)] == before
    assert engine.compilations_since_warmup == 0


def test_calibration_runs_the_warmup_batches_of_short_steps_only(llm, monkeypatch):
    engine = llm.engine
    ran, idle = [], {1: 0.01, 8: 0.01, 32: 0.5}  # bucket 32 is made a long step
    monkeypatch.setattr(engine.runner, "run_warmup_batches", ran.append)
    monkeypatch.setattr(engine.runner, "time_idle_step", lambda bucket, verify=False: idle[bucket] * (1 + verify))
    monkeypatch.setattr(engine.timing, "timed_buckets", set())
    monkeypatch.setattr(engine.scheduler, "step_cost", copy.deepcopy(engine.scheduler.step_cost))
    monkeypatch.setattr(engine.speculator, "verify_cost", StepCostModel(engine.speculator.verify_cost.buckets))
    engine.calibrate_step_cost()
    assert step_timing.WARMUP_BATCHES_BELOW_SECONDS < 0.5 and sorted(ran) == [1, 8]
    # The engine verifies drafts: a verify step of each bucket that holds one was timed for their price.
    verify = engine.speculator.verify_cost
    assert verify.base_seconds(8) == pytest.approx(0.02) and verify.base_seconds(32) == pytest.approx(1.0)
