"""Layers under `lax.scan` (`--layer-loop scan`, jaxserve/model/layer_loop.py) compute what unrolled layers do.

1. The period of layers that repeats: 1 for Llama and Mixtral, 2 for Gemma 2's sliding / global pairs, none
   (the stage stays unrolled) for Gemma 3's 5 : 1 pattern over 6 layers and a MoE whose `mlp_only_layers`
   break it.
2. The golden transformers logits (tests/fixtures/parity) within 1e-4 through chunked prefill and paged
   decode in mixed ragged batches, with the scanned stage model: a Llama, Gemma 2 (a period of two kinds
   of layer, soft caps, sliding windows narrower than the prompt) and Mixtral (routed experts). LoRA
   adapters (traced layer index into the adapters' stacks) against peft.
3. stories260K served with scanned layers: the same greedy tokens as unrolled ones, with float32 and with
   int8 weights and int8 KV pages; nothing compiles after warm-up; the parameters are really stacked.
4. A restart loads the scanned programs from the program cache.
The 8-device suite runs a scanned model under tensor and pipeline parallelism (tests/multidevice).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.model.layer_loop import layer_period, resolve_layer_loop
from jaxserve.model.registry import abstract_model
from tests.test_parity import FIXTURES, check_parity, make_runner

PROMPTS = ["Once upon a time", "", "The cat sat on", "Lily and Tom went to the park to"]
# The suite's shared stories260K engine (tests/conftest.py: buckets 4 and 64) gives the unrolled reference
# tokens; the scanned engines here compile one program, the 64-token bucket (the scan, not bucket choice, is
# the subject: a scanned engine's small buckets are the restart test's, 3 and 12).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,))


@pytest.mark.parametrize("case, period", [("llama_gqa_untied", 1), ("gemma2_softcap", 2), ("gemma3_text", 6),
                                          ("qwen3_moe", 3), ("mixtral", 1)])
def test_the_repeating_period_of_layers(case, period):
    layers = abstract_model(ModelConfig.from_pretrained(FIXTURES / case), jnp.float32).layers
    assert layer_period([nnx.graphdef(layer) for layer in layers]) == period


def test_auto_unrolls_on_cpu_and_scans_elsewhere():
    assert resolve_layer_loop("auto", "cpu") == resolve_layer_loop("auto", "gpu") == "unroll"
    assert resolve_layer_loop("auto", "tpu") == "scan"
    assert resolve_layer_loop("scan", "cpu") == "scan"
    with pytest.raises(ValueError, match="layer_loop must be one of"):
        resolve_layer_loop("loop", "cpu")


@pytest.mark.parametrize("case", ["llama_gqa_untied", "gemma2_softcap", "mixtral"])
def test_scanned_layers_match_transformers(case):
    # One program (the prefill budget runs the decodes too): the scan, not bucket choice, is the subject.
    runner = make_runner(case, layer_loop="scan")
    config = ModelConfig.from_pretrained(FIXTURES / case)
    layers = runner.params["layers"]  # one period of layers, each parameter stacked over the repeats
    assert len(layers) < config.num_layers
    assert layers[0]["input_layernorm"]["weight"][...].shape == (config.num_layers // len(layers),
                                                                 config.hidden_size)
    check_parity(runner, np.load(FIXTURES / case / "golden.npz"), mixed=True)


def test_scanned_layers_with_lora_adapters_match_peft():
    from tests.test_lora_parity import check_every_adapter_in_one_batch, make_runner as lora_runner
    runner = lora_runner(layer_loop="scan", token_buckets=(152,))
    assert runner.layer_repeats == 2 and runner.kv_cache.folded  # the fixture's 2 layers as one, scanned
    check_every_adapter_in_one_batch(runner)


def _greedy(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "kv_cache_dtype": "int8"}],
                         ids=["float32", "int8-weights-and-pages"])
def test_a_scanned_engine_serves_the_unrolled_tokens(stories_dir, stories_llm, options):
    # The float32 run is checked against the suite's shared engine; the int8 pair builds its own reference.
    scanned = LLM(str(stories_dir), **ENGINE, layer_loop="scan", **options)
    runner = scanned.engine.runner
    assert runner.graphdef != stories_llm.engine.runner.graphdef
    # stories260K: 5 identical layers -> one layer, every parameter stacked 5 deep.
    assert len(runner.params["layers"]) == 1
    assert all(a.shape[0] == 5 for a in jax.tree.leaves(runner.params["layers"][0]))
    reference = stories_llm if not options else LLM(str(stories_dir), **ENGINE, layer_loop="unroll", **options)
    assert _greedy(scanned) == _greedy(reference)
    scanned.generate(["A", "Once upon a time there was"], SamplingParams(temperature=0.8, seed=3, max_tokens=20))
    assert scanned.engine.compilations_since_warmup == 0


def test_a_restart_loads_the_scanned_programs_from_the_program_cache(stories_dir, stories_llm, tmp_path,
                                                                       monkeypatch):
    """The scanned stage model's programs are keyed by its graph (one period, its repeats): a restart loads
    them instead of tracing, and they serve the unrolled engine's tokens."""
    from jaxserve.execution.program_cache import ProgramCache
    monkeypatch.setattr(ProgramCache, "beside_jax_cache", classmethod(lambda cls: cls(tmp_path)))
    reference = _greedy(stories_llm)
    for restart in (False, True):
        # Shapes no other test uses: a program JAX's cache (shared by the run) already held would come from
        # there, and is never copied into the program cache (see tests/test_compilation_cache.py).
        llm = LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=12, token_buckets=(3, 12),
                  layer_loop="scan")
        report = llm.engine.warmup_report
        assert report.programs == 2 and report.program_cache_hits == (2 if restart else 0)
        assert _greedy(llm) == reference
        assert llm.engine.compilations_since_warmup == 0


def test_a_scanned_target_verifies_a_draft_model_s_tokens(stories_dir, stories_llm, tmp_path):
    """Speculative decoding over scanned layers: the draft model (its own unrolled program and cache) proposes,
    the scanned target verifies K + 1 positions in its folded cache; greedy tokens as without speculation."""
    from tests.test_speculative import truncated_draft
    draft = truncated_draft(stories_dir, tmp_path / "stories-3-layers", 3)
    llm = LLM(str(stories_dir), **ENGINE, layer_loop="scan",
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    assert llm.engine.runner.kv_cache.folded and not llm.engine.speculator.proposer.kv_cache.folded
    assert _greedy(llm) == _greedy(stories_llm)
    assert llm.engine.compilations_since_warmup == 0
