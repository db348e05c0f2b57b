"""LoRA adapters through the ragged step against transformers + peft (issue 31, item 1).

The fixtures (tests/fixtures/lora/README.md, made by tools/make_lora_fixtures.py) are a tiny random Llama and
four PEFT adapters with golden float32 logits over one shared 48-token prompt and each model's 16 greedy
tokens. Every logit must agree within 1e-4 and the greedy tokens must be identical, for each adapter alone
and for all of them (and the base, and a sequence with no adapter beside them) in one ragged batch: the
prompt in two chunks, then one token per step over the paged cache, every sequence with its own slot.
Also: adapters are written into slots while the step programs stay the same (no compilation), and a slot
reused by another adapter holds nothing of the previous one.
"""

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.execution.runner import ModelRunner
from jaxserve.loader.load import load_sharded
from jaxserve.loader import placement
from jaxserve.loader.placement import scan_layers
from jaxserve.lora.adapter import load_adapter
from jaxserve.lora.slots import LoRASlots
from jaxserve.scheduling.pages import PageAllocator, pages_needed
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from pallas_kernels.dispatch import select_attention_backend
from sharding import ParallelConfig, make_plan

LORA = Path(__file__).parent / "fixtures" / "lora"
ADAPTERS = ("r4_qv", "r8_all", "r8_rslora_attn", "r4_mlp_alpha4")
PAGE_SIZE = 8
MAX_LEN = 72
MAX_RANK = 8


def make_runner(parallel: ParallelConfig = ParallelConfig(), layer_loop: str = "unroll",
                token_buckets: tuple[int, ...] = (6, 152), feature_major: bool = False) -> ModelRunner:
    config = ModelConfig.from_pretrained(LORA / "base")
    plan = make_plan(parallel, num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(LORA / "base", config, jnp.float32, plan)
    if layer_loop == "scan":
        model = scan_layers(model)
    if feature_major:  # the CPU's turned linear layers (jaxserve/model/feature_major.py)
        model = placement.feature_major(model)
    # Token buckets no other test uses (the run shares one compilation cache): decodes of six sequences,
    # and prefill chunks of them.
    return ModelRunner(model, config, CacheConfig(page_size=PAGE_SIZE, num_pages=96),
                       SchedulerConfig(max_num_seqs=6, max_model_len=MAX_LEN, max_num_batched_tokens=152,
                                       token_buckets=token_buckets),
                       select_attention_backend("auto"), jnp.float32,
                       lora=LoRASlots(config, max_loras=4, max_rank=MAX_RANK, dtype=jnp.float32, plan=plan))


@pytest.fixture(scope="module")
def runner():
    runner = make_runner()
    runner.warmup()
    return runner


def golden(name: str):
    return np.load(LORA / name / "golden.npz")


def run_sequences(runner: ModelRunner, cases: list[tuple[str, int]]) -> dict[int, tuple[np.ndarray, list[int]]]:
    """Each (golden case, slot) as one sequence of a shared ragged batch: its prompt in two chunks, then its
    golden continuation one token per step. Returns per sequence its logits [64, vocab] and greedy tokens."""
    per_seq = pages_needed(MAX_LEN, PAGE_SIZE)
    free = PageAllocator(96).allocate(len(cases) * per_seq)[::-1]  # shuffled, non-contiguous page lists
    goldens = [golden(name) for name, _ in cases]
    ids = goldens[0]["input_ids"].tolist()
    prompt_len = int(goldens[0]["prompt_len"])
    logits = [[] for _ in cases]
    drawn = [[] for _ in cases]

    def step(spans: list[tuple[int, list[int]]]):
        seqs = [dataclasses.replace(ScheduledSeq.for_sequence(i, free[i * per_seq:(i + 1) * per_seq], start, tokens),
                                    lora_slot=cases[i][1]) for i, (start, tokens) in enumerate(spans)]
        out = runner.run(StepPlan.of(seqs))
        for i in range(len(cases)):
            logits[i].append(out.logits[out.rows[i]])
            drawn[i].append(int(out.samples[i]))

    step([(0, ids[:24])] * len(cases))
    step([(24, ids[24:prompt_len])] * len(cases))
    for position in range(prompt_len, len(ids) - 1):  # each sequence follows its own golden tokens
        step([(position, [int(g["input_ids"][position])]) for g in goldens])
    return {i: (np.concatenate(logits[i]), drawn[i][1:]) for i in range(len(cases))}


def check(result, name: str) -> None:
    logits, drawn = result
    g = golden(name)
    np.testing.assert_allclose(logits, g["logits"][:-1], atol=1e-4, rtol=0, err_msg=name)
    assert drawn == g["input_ids"][int(g["prompt_len"]):].tolist(), name


def load_into(runner: ModelRunner, slots: dict[int, str]) -> None:
    config = runner.model_config
    for slot, name in slots.items():
        runner.write_lora(slot, load_adapter(LORA / name, config, MAX_RANK))


def check_every_adapter_in_one_batch(runner: ModelRunner) -> None:
    """The base and the four adapters, each in its own slot, in one ragged batch, against PEFT (for runners
    built another way: scanned layers, feature-major products)."""
    runner.warmup()
    load_into(runner, {1: "r8_all", 2: "r4_qv", 3: "r4_mlp_alpha4", 4: "r8_rslora_attn"})
    cases = [("base", 0), ("r4_qv", 2), ("r8_all", 1), ("r4_mlp_alpha4", 3), ("r8_rslora_attn", 4)]
    assert {name for name, _ in cases} >= set(ADAPTERS)
    results = run_sequences(runner, cases)
    for i, (name, _) in enumerate(cases):
        check(results[i], name)


@pytest.mark.parametrize("name", ADAPTERS)
def test_each_adapter_alone_matches_peft(runner, name):
    load_into(runner, {2: name})
    check(run_sequences(runner, [(name, 2)])[0], name)


def test_mixed_batch_matches_peft_and_loading_compiles_nothing(runner):
    """Base, four adapters and the base again (slot 0) in every step. Then slots are rewritten between
    steps: the same programs run (the stacks are an input of the step), nothing compiles."""
    load_into(runner, {1: "r8_all", 2: "r4_qv", 3: "r4_mlp_alpha4", 4: "r8_rslora_attn"})
    cases = [("base", 0), ("r4_qv", 2), ("r8_all", 1), ("base", 0), ("r4_mlp_alpha4", 3), ("r8_rslora_attn", 4)]
    results = run_sequences(runner, cases)
    for i, (name, _) in enumerate(cases):
        check(results[i], name)
    before = runner.events.lowered
    # A slot reused by a smaller adapter keeps nothing of the one before (r8 over all modules -> r4 on q/v),
    # and a cleared slot is the base model.
    load_into(runner, {1: "r4_qv"})
    check(run_sequences(runner, [("r4_qv", 1)])[0], "r4_qv")
    runner.write_lora(1, None)
    check(run_sequences(runner, [("base", 1)])[0], "base")
    assert runner.events.lowered == before


@pytest.mark.parametrize("dense_slots", [0, 8], ids=["gather", "dense"])
def test_both_formulations_of_the_term_match_numpy(monkeypatch, dense_slots):
    """The step's term per token is (x @ A[slot]) @ B[slot], by the per-token gather (many slots or few
    tokens) and by the side-by-side matmul over all slots (few slots); slot 0 adds nothing."""
    from jaxserve.lora import delta as lora_delta

    monkeypatch.setattr(lora_delta, "DENSE_SLOTS", dense_slots)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 12, 4)).astype(np.float32)
    b = rng.standard_normal((5, 4, 7)).astype(np.float32)
    a[0], b[0] = 0, 0
    x = rng.standard_normal((9, 12)).astype(np.float32)
    slots = np.array([0, 3, 3, 1, 4, 0, 2, 2, 4], np.int32)
    layer = lora_delta.LayerLoRA({"q_proj": jnp.asarray(a)}, {"q_proj": jnp.asarray(b)}, jnp.asarray(slots))
    expected = np.stack([x[t] @ a[s] @ b[s] for t, s in enumerate(slots)])
    np.testing.assert_allclose(np.asarray(lora_delta.delta(layer, "q_proj", jnp.asarray(x))), expected,
                               rtol=1e-5, atol=1e-5)
    assert lora_delta.delta(layer, "k_proj", jnp.asarray(x)) is None
