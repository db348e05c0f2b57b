"""Feature-major linear layers (`--cpu-matmul-library ynnpack-feature-major`, jaxserve/model/feature_major.py):
the product in both of its forms, the turned model's tokens, unrolled and under lax.scan, and the
row-parallel path every step takes inside its shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve import LLM, SamplingParams
from jaxserve.config import LinearQuantization
from jaxserve.model import parallel
from jaxserve.model.feature_major import ISLAND_BELOW_ROWS, FeatureMajorLinear, feature_major_product
from jaxserve.model.quantized_linear import QuantizedLinear
from jaxserve.quantization import quantize_weight

PROMPTS = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park to play with their ball and", ""]


@pytest.mark.parametrize("rows", [1, 3, ISLAND_BELOW_ROWS - 1, ISLAND_BELOW_ROWS, 2 * ISLAND_BELOW_ROWS + 5])
def test_the_product_is_x_times_the_transposed_weight_in_both_forms(rows):
    rng = np.random.default_rng(rows)
    weight = jnp.asarray(rng.standard_normal((48, 40), dtype=np.float32))  # [out, in]
    x = jnp.asarray(rng.standard_normal((rows, 40), dtype=np.float32))
    got = jax.jit(feature_major_product)(weight, x)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(weight).T, rtol=1e-5, atol=1e-5)
    # leading axes are kept, and the row count that picks the form is their product
    np.testing.assert_allclose(jax.jit(feature_major_product)(weight, x.reshape(1, rows, 40)), got[None], rtol=1e-6)


@pytest.mark.parametrize("kind", ["feature-major", "int8"])
def test_row_parallel_adds_the_extra_term_of_a_layer_with_its_own_product(kind):
    """Inside the step's shard_map `row_parallel` calls `project` and adds the partial sum `extra` (a LoRA
    term on o_proj or down_proj) before its all-reduce and the bias after it. Quantized layers dropped it
    before feature-major layers shared their branch."""
    rng = np.random.default_rng(0)
    weight = jnp.asarray(rng.standard_normal((6, 5), dtype=np.float32))  # [out, in]
    bias, x = jnp.arange(6, dtype=jnp.float32), jnp.asarray(rng.standard_normal((3, 5), dtype=np.float32))
    extra = jnp.full((3, 6), 0.5, jnp.float32)
    if kind == "int8":
        spec = LinearQuantization(codes="int8", strategy="dynamic_int8")
        linear = QuantizedLinear(5, 6, use_bias=True, spec=spec, dtype=jnp.float32)
        qw = quantize_weight(weight.T)
        linear.codes[...], linear.scales[...], linear.bias[...] = qw.codes, qw.scales, bias
    else:
        linear = FeatureMajorLinear(weight, bias)
    mesh = jax.make_mesh((1,), ("tensor",))
    run = jax.shard_map(lambda x, e: parallel.row_parallel(linear, x, "tensor", e), mesh=mesh,
                        in_specs=(P(), P()), out_specs=P())
    expected = linear(x) + 0.5
    np.testing.assert_allclose(run(x, extra), expected, rtol=1e-5)
    tolerance = 0.05 if kind == "int8" else 1e-5  # int8 codes and row scales against the float product
    np.testing.assert_allclose(expected, np.asarray(x) @ np.asarray(weight).T + 0.5 + np.asarray(bias),
                               rtol=tolerance, atol=tolerance)


def _param_names(llm) -> list[str]:
    return ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(llm.engine.runner.params)]


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_a_feature_major_engine_gives_the_same_tokens(stories_dir, stories_llm, layer_loop):
    """stories260K (its own engine takes YNNPACK's `x @ W`) turned feature-major: 4-token decode steps run
    the barrier islands, 64-token prefill steps the direct product, q/k/v and gate/up fused; the greedy
    tokens do not change."""
    turned = LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(4, 64),
                 cpu_matmul_library="ynnpack-feature-major", layer_loop=layer_loop)
    assert any(name.endswith("kernel") for name in _param_names(stories_llm))
    names = _param_names(turned)
    assert not any(name.endswith("kernel") for name in names)  # every linear layer turned (the head is tied)
    # q, k, v and gate, up as one product each; o and down on their own
    assert "layers/0/self_attn/fused_projections/weight" in names and "layers/0/mlp/fused_projections/weight" in names
    assert "layers/0/self_attn/o_proj/weight" in names and "layers/0/self_attn/q_proj/weight" not in names
    greedy = SamplingParams(temperature=0, max_tokens=32)
    assert ([o.outputs[0].token_ids for o in turned.generate(PROMPTS, greedy)] ==
            [o.outputs[0].token_ids for o in stories_llm.generate(PROMPTS, greedy)])
    assert turned.engine.compilations_since_warmup == 0


def test_feature_major_layers_refuse_a_mesh():
    from jaxserve.execution.cpu_matmuls import FEATURE_MAJOR, resolve_cpu_matmuls
    from tests.test_cpu_matmuls import _config
    with pytest.raises(ValueError, match="one device"):
        resolve_cpu_matmuls(FEATURE_MAJOR, "cpu", _config(64), jnp.float32, devices=2)


@pytest.mark.parametrize("case", ["llama_gqa_untied", "qwen2_bias", "gemma2_softcap", "qwen3_moe"])
def test_feature_major_steps_match_transformers(case):
    """The parity fixtures' golden float32 logits within 1e-4, turned: an untied LM head, q/k/v biases
    fused with their projections, Gemma's gated MLP, a mixture of experts (attention and router turned,
    experts held apart as a one-device CPU engine holds them); decodes, lone and beside the companions, in
    the 8-token bucket (the islands, under ISLAND_BELOW_ROWS), prefill chunks in 64 (the direct product). A
    one-row island (what a CPU's batch-1 decode runs) is the same code at one row, which the product test
    above checks."""
    from tests.test_parity import FIXTURES, check_parity, make_runner
    runner = make_runner(case, token_buckets=(8, 64), feature_major=True, split_experts=case == "qwen3_moe")
    golden = np.load(FIXTURES / case / "golden.npz")
    check_parity(runner, golden, mixed=False)
    check_parity(runner, golden, mixed=True)


def test_feature_major_layers_with_lora_adapters_match_peft():
    """LoRA terms are added to the fused projections' slices and, for o and down, before the all-reduce;
    6-token decodes run the islands, 152-token prefills the direct product."""
    from tests.test_lora_parity import check_every_adapter_in_one_batch, make_runner as lora_runner
    check_every_adapter_in_one_batch(lora_runner(feature_major=True))
