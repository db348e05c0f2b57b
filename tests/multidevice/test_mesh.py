"""Tensor and pipeline parallelism on 8 fake CPU devices give what one device gives.

1. stories260K (8 query heads, 4 KV heads, 5 layers): greedy tokens for several prompts, batched, equal
   the one-device run on tp 8, pp 2 and tp 4 x pp 2 meshes (and tp 2 x pp 2, restarted). tp 8 replicates each KV head twice; pp 2
   splits 5 layers 3 + 2 (one padding layer) and cuts each step's tokens into 2 microbatches. Nothing
   recompiles after warm-up under any mesh.
2. The golden transformers logits (tests/fixtures/parity) are matched within 1e-4 through chunked
   prefill and paged decode in mixed ragged steps on sharded meshes, covering biases (row-parallel bias
   added once), tied and untied heads, q/k norms, sliding windows and tp > KV heads.
"""

from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from sharding import ParallelConfig
from tests.test_parity import check_parity, make_runner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parity"
PROMPTS = ["Once upon a time", "", "The cat sat on", "Lily and Tom went to the park to"]
# tp 8 replicates KV heads, pp 2 alone splits the layers and the steps' tokens, tp 4 x pp 2 does both (tp 2 x
# pp 2 is the restart test's mesh below).
MESHES = [(1, 1), (8, 1), (1, 2), (4, 2)]


_LLMS: dict = {}


# One step program per mesh, the budget, which runs the decodes too (padded): a program compiles for seconds on
# 8 devices, and bucket choice is the single-device suite's subject (tests/test_engine.py), not the mesh's.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,), max_model_len=128)
# The parity runners likewise: one program (the prefill budget) for the decode steps and the prompt chunks.
PARITY_BUCKETS = (64,)


def _llm(stories_dir, tp, pp):
    if (tp, pp) not in _LLMS:
        _LLMS[(tp, pp)] = LLM(str(stories_dir), **ENGINE, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return _LLMS[(tp, pp)]


def _greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def one_device_tokens(stories_dir, story_text):
    llm = _llm(stories_dir, 1, 1)
    assert len(llm.engine.plan.mesh.devices.flat) == 1
    tokens = _greedy(llm)
    story = llm.get_tokenizer().encode(story_text, add_special_tokens=False)
    assert tokens[1] == story[:48]  # the documented story, from the bare BOS prompt
    return tokens


@pytest.mark.parametrize("tp, pp", MESHES, ids=[f"tp{t}-pp{p}" for t, p in MESHES])
def test_greedy_tokens_match_one_device(stories_dir, one_device_tokens, tp, pp):
    llm = _llm(stories_dir, tp, pp)
    plan = llm.engine.plan
    assert (plan.tp, plan.pp, plan.mesh.devices.size) == (tp, pp, tp * pp)
    assert plan.kv_replicas == (2 if tp == 8 else 1)
    assert _greedy(llm) == one_device_tokens
    # Two more batches of different shapes of work: still nothing compiles after warm-up.
    llm.generate(["A", "Once upon a time there was"], SamplingParams(temperature=0.8, seed=3, max_tokens=20))
    assert llm.engine.compilations_since_warmup == 0


def test_params_and_cache_are_really_split(stories_dir):
    llm = _llm(stories_dir, 4, 2)
    runner = llm.engine.runner
    q = runner.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert q.shape == (2 * 64, 64)  # two stages stacked on dim 0
    assert q.addressable_shards[0].data.shape == (64, 16)  # one stage's layer, a quarter of the heads
    embedding = runner.params["embed_tokens"]["embedding"][...]
    assert embedding.addressable_shards[0].data.shape == (512 // 4, 64)  # vocabulary-parallel
    k_pages = runner.kv_cache.k[0]
    assert k_pages.shape[0] == 2 * 4 and k_pages.addressable_shards[0].data.shape[0] == 1


# llama_bias is llama_gqa_untied's model (4 query / 2 KV heads, untied) with biases, so its tp 4 (KV heads
# replicated) and tp 2 x pp 2 (a KV head a device) runs hold the Llama's own tp 4 and tp 2 runs too: the
# Llama keeps the meshes nothing else covers, pp 2 alone and tp 4 x pp 2.
PARITY_CASES = [
    ("llama_gqa_untied", 1, 2), ("llama_gqa_untied", 4, 2), ("llama_bias", 2, 2), ("llama_bias", 4, 1),
    ("qwen2_bias", 4, 2),
    ("qwen3_qknorm", 2, 2), ("mistral_sliding", 8, 1), ("llama3_tied_headdim", 4, 2),
    # Issue-29 families: pipeline stages must repeat the layer pattern (Gemma 2's S F | S F does, Gemma 3's
    # S S S S S F over 6 layers does not split; Qwen3-MoE's pp 2 is in test_checkpoint.py's loading test).
    ("gemma2_softcap", 2, 2), ("gemma3_text", 2, 1), ("qwen3_moe", 4, 1), ("mixtral", 2, 2),
]


@pytest.mark.parametrize("case, tp, pp", PARITY_CASES, ids=[f"{c}-tp{t}-pp{p}" for c, t, p in PARITY_CASES])
def test_sharded_logits_match_transformers(case, tp, pp):
    # Mixed ragged batches: with pp 2 the target's prefill chunk straddles the two pipeline microbatches.
    runner = make_runner(case, parallel=ParallelConfig(tp, pp), token_buckets=PARITY_BUCKETS)
    check_parity(runner, np.load(FIXTURES / case / "golden.npz"), mixed=True)


def test_a_restart_on_a_mesh_loads_its_programs_and_matches_one_device(stories_dir, one_device_tokens, tmp_path,
                                                                        monkeypatch):
    """Programs split over tensor and pipeline parallel devices come back from the program cache on the
    devices they were compiled for, and compute what one device computes."""
    from jaxserve.execution.program_cache import ProgramCache
    monkeypatch.setattr(ProgramCache, "beside_jax_cache", classmethod(lambda cls: cls(tmp_path)))
    for restart in (False, True):
        # Two step programs (not six): the test is about loading them, and each compiles for seconds. Their
        # shapes are this test's own: a program JAX's cache (shared by the run) already held would come from
        # there, and is never copied into the program cache (see tests/test_compilation_cache.py).
        llm = LLM(str(stories_dir), max_num_seqs=4, token_buckets=(2, 8), max_model_len=128,
                  tensor_parallel_size=2, pipeline_parallel_size=2)
        report = llm.engine.warmup_report
        assert report.programs > 1 and report.program_cache_hits == (report.programs if restart else 0)
        assert _greedy(llm) == one_device_tokens
        assert llm.engine.compilations_since_warmup == 0


EXPERT_PARALLEL_CASES = [("qwen3_moe", 4, 1), ("mixtral", 4, 2)]


@pytest.mark.parametrize("case, tp, pp", EXPERT_PARALLEL_CASES,
                         ids=[f"{c}-ep{t}-pp{p}" for c, t, p in EXPERT_PARALLEL_CASES])
def test_expert_parallel_logits_match_transformers(case, tp, pp):
    """--enable-expert-parallel: each tensor-parallel device holds 8 / tp whole experts."""
    runner = make_runner(case, parallel=ParallelConfig(tp, pp, enable_expert_parallel=True),
                         token_buckets=PARITY_BUCKETS)
    block = "mlp" if case == "qwen3_moe" else "block_sparse_moe"
    gate = runner.params["layers"][0][block]["experts"]["gate_proj" if case == "qwen3_moe" else "w1"][...]
    assert gate.addressable_shards[0].data.shape == (8 // tp, 64, 16)  # whole experts, a tp-th of them
    check_parity(runner, np.load(FIXTURES / case / "golden.npz"), mixed=True)


def test_scanned_layers_on_a_tensor_and_pipeline_mesh(stories_dir, one_device_tokens):
    """--layer-loop scan under tp 2 x pp 2: each stage's 3 layer slots (one padding) run as one scanned
    layer, its parameters stacked 3 deep in front of the stage axis, and serve the one-device tokens."""
    llm = LLM(str(stories_dir), **ENGINE, tensor_parallel_size=2, pipeline_parallel_size=2, layer_loop="scan")
    runner = llm.engine.runner
    q = runner.params["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert len(runner.params["layers"]) == 1 and q.shape == (3, 2 * 64, 64)
    assert q.addressable_shards[0].data.shape == (3, 64, 32)  # every repeat, one stage, half the heads
    k_pages = runner.kv_cache.k  # the stage's 3 layers' blocks of pages in one array, stages on dim 0
    assert k_pages.shape[:2] == (2 * 4, 3 * runner.cache_config.num_pages)
    assert k_pages.addressable_shards[0].data.shape[:2] == (2, 3 * runner.cache_config.num_pages)
    assert _greedy(llm) == one_device_tokens
    llm.generate(["A", "Once upon a time there was"], SamplingParams(temperature=0.8, seed=3, max_tokens=20))
    assert llm.engine.compilations_since_warmup == 0


@pytest.mark.parametrize("case, tp", [("gemma2_softcap", 4), ("mixtral", 2)])
def test_scanned_sharded_logits_match_transformers(case, tp):
    """A scanned period of two kinds of layer (Gemma 2) and routed experts (Mixtral) on a tensor group."""
    runner = make_runner(case, parallel=ParallelConfig(tp, 1), layer_loop="scan", token_buckets=PARITY_BUCKETS)
    assert runner.params["layers"][0]["input_layernorm"]["weight"][...].shape[0] == 2  # stacked repeats
    check_parity(runner, np.load(FIXTURES / case / "golden.npz"), mixed=True)
