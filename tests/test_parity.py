"""Numerical parity with Hugging Face transformers (float32) on small random configs, through the ragged step:
logits, greedy tokens, and the log-probabilities the step returns (sampled and prompt tokens, top 5).

The golden logits were produced by `tools/make_parity_fixtures.py` (see tests/fixtures/parity/README.md):
a 48-token prompt plus 16 greedy tokens, and the full-sequence logits. Here the prompt goes through the
step in two chunks and the rest one token per step over the paged cache; every logit must agree within
1e-4 and the greedy tokens must be identical — alone, and mixed into ragged batches with other sequences
(a decode before it and a prefill chunk after it in the flat token array).
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import SUPPORTED_MODEL_TYPES, CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.scheduling.pages import PageAllocator, pages_needed
from jaxserve.execution.runner import ModelRunner
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from jaxserve.loader.load import load_sharded
from jaxserve.loader import placement
from jaxserve.loader.placement import scan_layers
from pallas_kernels.dispatch import select_attention_backend
from sharding import ParallelConfig, make_plan

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
# Goldens of families the engine does not load yet (issue 29: gemma2, gemma3_text, qwen3_moe, mixtral) join
# these cases by themselves once their model_type is in SUPPORTED_MODEL_TYPES.
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file()
               and json.loads((p / "config.json").read_text())["model_type"] in SUPPORTED_MODEL_TYPES)
PAGE_SIZE = 8
MAX_LEN = 128


def test_every_supported_model_type_has_a_fixture():
    types = {ModelConfig.from_pretrained(FIXTURES / c).model_type for c in CASES}
    assert types == set(SUPPORTED_MODEL_TYPES)


def make_runner(case: str, backend: str = "auto", parallel: ParallelConfig = ParallelConfig(),
                layer_loop: str = "unroll", token_buckets: tuple[int, ...] = (64,),
                feature_major: bool = False, split_experts: bool = False) -> ModelRunner:
    config = ModelConfig.from_pretrained(FIXTURES / case)
    plan = make_plan(parallel, num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(FIXTURES / case, config, jnp.float32, plan)
    if layer_loop == "scan":
        model = scan_layers(model)
    if feature_major:  # the CPU's turned linear layers (jaxserve/model/feature_major.py)
        model = placement.feature_major(model)
    if split_experts:  # what a one-device CPU engine runs (jaxserve/model/moe.py's SplitExperts)
        model = placement.split_experts(model)
    # One step program, the budget: prefill chunks, and the decodes (with the companions: up to 7 tokens)
    # padded to it. Parity is about the model's arithmetic, which is the same in every bucket; bucket
    # choice is the engine tests' subject. The alone and mixed runs of a case share it, compiled once per
    # run (the suite's compilation cache).
    return ModelRunner(model, config, CacheConfig(page_size=PAGE_SIZE, num_pages=64),
                       SchedulerConfig(max_num_seqs=3, max_model_len=MAX_LEN, max_num_batched_tokens=64,
                                       token_buckets=token_buckets),
                       select_attention_backend(backend), jnp.float32)


_SHARED: dict[str, ModelRunner] = {}


def shared_runner(case: str) -> ModelRunner:
    """`make_runner(case)`, built once per process: the case's alone, mixed and prefix-hit tests all run on it,
    so its model is loaded and its step traced once rather than three times. Sharing is safe because each
    test writes every page position it reads before reading it, as a run on a fresh runner does."""
    if case not in _SHARED:
        _SHARED[case] = make_runner(case)
    return _SHARED[case]


def check_parity(runner: ModelRunner, golden, mixed: bool) -> None:
    """Prefill 32 + 16 tokens, then decode, comparing the target sequence's logits with the golden ones."""
    ids, prompt_len, ref_logits = golden["input_ids"].tolist(), int(golden["prompt_len"]), golden["logits"]
    vocab = ref_logits.shape[1]
    # Shuffled, non-contiguous page lists, so page-table indexing is really exercised.
    per_seq = pages_needed(MAX_LEN, PAGE_SIZE)
    free = PageAllocator(64).allocate(3 * per_seq + 4)[::-1]
    pages = {slot: free[slot * per_seq:(slot + 1) * per_seq] for slot in range(3)}
    rng = np.random.default_rng(0)
    other = {slot: [0] for slot in (0, 2)}  # positions already filled for the companion sequences

    def companions():
        """A one-token decode for slot 0 and a 5-token prefill chunk for slot 2, each at its next position."""
        out = {}
        for slot, n in ((0, 1), (2, 5)):
            start = other[slot][0]
            if start + n < MAX_LEN:
                out[slot] = ScheduledSeq.for_sequence(slot, pages[slot], start, rng.integers(0, vocab, n).tolist())
                other[slot][0] += n
        return out

    def step(token_ids, start):
        target = ScheduledSeq.for_sequence(1, pages[1], start, token_ids, params=LOGPROBS)
        extra = companions() if mixed else {}
        chunks = [c for c in (extra.get(0), target, extra.get(2)) if c is not None]
        out = runner.run(StepPlan.of(chunks))
        i = chunks.index(target)
        rows, r = out.rows[i], out.results
        positions = range(start, start + len(token_ids))
        # Sampled token: its logprob, rank and the top 5, against the golden logits of the last position.
        d = r.draws
        check_logprobs(ref_logits[positions[-1]], int(out.samples[i]), d.sample_logprob[i, 0], d.sample_rank[i, 0],
                       d.top_ids[i, 0], d.top_logprobs[i, 0])
        # Prompt logprobs: every row but the chunk's last scores the next token of the chunk.
        for row, position in zip(range(rows.start, rows.stop - 1), positions):
            check_logprobs(ref_logits[position], ids[position + 1], r.prompt_logprob[row], r.prompt_rank[row],
                           r.prompt_top_ids[row], r.prompt_top_logprobs[row])
        return int(out.samples[i]), out.logits[rows]

    _, logits_a = step(ids[:32], 0)
    first, logits_b = step(ids[32:prompt_len], 32)
    np.testing.assert_allclose(np.concatenate([logits_a, logits_b]), ref_logits[:prompt_len], atol=1e-4, rtol=0)
    assert first == ids[prompt_len]
    generated = [first]
    for position in range(prompt_len, len(ids) - 1):
        token, logits = step([generated[-1]], position)
        np.testing.assert_allclose(logits[0], ref_logits[position], atol=1e-4, rtol=0)
        generated.append(token)
    assert generated == ids[prompt_len:]


LOGPROBS = SamplingParams(temperature=0, max_tokens=None, logprobs=5, prompt_logprobs=5)


def check_logprobs(ref_logits, token: int, logprob, rank, top_ids, top_logprobs, k: int = 5) -> None:
    """A step's logprob results for one row against log_softmax of the golden float32 logits."""
    ref = ref_logits.astype(np.float64) - np.logaddexp.reduce(ref_logits.astype(np.float64))
    np.testing.assert_allclose(logprob, ref[token], atol=1e-4, rtol=0)
    assert rank == 1 + int(np.sum(ref > ref[token] + 1e-6))
    order = np.argsort(-ref, kind="stable")[:k]
    np.testing.assert_allclose(top_logprobs[:k], ref[order], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ref[top_ids[:k]], ref[order], atol=1e-4, rtol=0)  # ties may swap ids


@pytest.mark.parametrize("mixed", [False, True], ids=["alone", "mixed"])
@pytest.mark.parametrize("case", CASES)
def test_step_matches_transformers(case, mixed):
    check_parity(shared_runner(case), np.load(FIXTURES / case / "golden.npz"), mixed)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_split_experts_match_transformers(case):
    """The experts as separate arrays, each tile's picked by lax.switch (what a one-device CPU engine runs):
    lone one-token decodes in the 1-token bucket (one row padded to a 2-row tile), decodes beside the
    companions in 8, prefill chunks in 64; alone and mixed."""
    runner = make_runner(case, token_buckets=(1, 8, 64), split_experts=True)
    golden = np.load(FIXTURES / case / "golden.npz")
    check_parity(runner, golden, mixed=False)
    check_parity(runner, golden, mixed=True)


@pytest.mark.parametrize("case", ["mistral_sliding", "llama_gqa_untied", "gemma2_softcap"])
def test_dense_reference_backend_matches_transformers(case):
    """The dense reference (the definition the kernels are tested against) through the whole model."""
    check_parity(make_runner(case, "reference"), np.load(FIXTURES / case / "golden.npz"), mixed=True)


# Goldens with 64 tokens of transformers' cached greedy generation (the issue-29 families).
GREEDY_CASES = [c for c in CASES if "greedy" in np.load(FIXTURES / c / "golden.npz").files]


@pytest.mark.parametrize("case", GREEDY_CASES)
def test_prefix_hit_then_64_greedy_tokens_match_transformers(case):
    """A sequence that finds the first 32 prompt tokens cached by another (a prefix-cache hit: its page
    table starts with the other's pages) prefills the other 16, then decodes 64 greedy tokens, far past
    every sliding window: logits within 1e-4 wherever a golden exists, tokens equal to `generate`'s."""
    runner, golden = shared_runner(case), np.load(FIXTURES / case / "golden.npz")
    ids, prompt_len, ref_logits = golden["input_ids"].tolist(), int(golden["prompt_len"]), golden["logits"]
    per_seq = pages_needed(MAX_LEN, PAGE_SIZE)
    free = PageAllocator(64).allocate(2 * per_seq + 1)[::-1]
    donor, own = free[:per_seq], free[per_seq:2 * per_seq]
    cached = 32 // PAGE_SIZE
    runner.run(StepPlan.of([ScheduledSeq.for_sequence(1, donor, 0, ids[:32])]))
    table = donor[:cached] + own[cached:]
    out = runner.run(StepPlan.of([ScheduledSeq.for_sequence(0, table, 32, ids[32:prompt_len])]))
    np.testing.assert_allclose(out.logits[out.rows[0]], ref_logits[32:prompt_len], atol=1e-4, rtol=0)
    generated = [int(out.samples[0])]
    for position in range(prompt_len, prompt_len + len(golden["greedy"]) - 1):
        out = runner.run(StepPlan.of([ScheduledSeq.for_sequence(0, table, position, [generated[-1]])]))
        if position < len(ref_logits):
            np.testing.assert_allclose(out.logits[out.rows[0]][0], ref_logits[position], atol=1e-4, rtol=0)
        generated.append(int(out.samples[0]))
    assert generated == golden["greedy"].tolist()
