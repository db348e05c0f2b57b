"""Model families beyond the Llama shape (issue 29): their configs in both spellings, per-layer data, refusals.

The numerical checks (golden logits alone, mixed, after a prefix hit, 64 greedy tokens) are in
tests/test_parity.py; these tests build no engine.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import FULL, SLIDING, ModelConfig
from jaxserve.loader.placement import check_stage_pattern
from jaxserve.model.moe import SplitExperts, grouped_ffn, routed_ffn, split_experts, tile_rows
from jaxserve.model.registry import random_model

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
FAMILY_FIXTURES = ["gemma2_softcap", "gemma3_text", "gemma3_text_hd256", "qwen3_moe", "mixtral"]


def _config(case: str, name: str = "config.json") -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((FIXTURES / case / name).read_text()))


@pytest.mark.parametrize("case", FAMILY_FIXTURES)
def test_legacy_spelling_reads_as_the_same_config(case):
    """transformers 4 keys (rope_theta / rope_scaling / rope_local_base_freq, sliding_window_pattern,
    num_experts, torch_dtype) and transformers 5 keys describe one model."""
    assert _config(case, "config_legacy.json") == _config(case)


def test_gemma2_per_layer_data():
    c = _config("gemma2_softcap")
    assert c.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert [c.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert c.attn_scale == 24 ** -0.5 and c.attn_logit_softcap == 10.0 and c.final_logit_softcap == 5.0
    assert c.hidden_act == "gelu_pytorch_tanh" and c.tie_word_embeddings and not c.qk_norm


def test_gemma3_two_rope_bases_and_pattern():
    c = _config("gemma3_text")
    assert c.layer_types == (SLIDING,) * 5 + (FULL,)
    assert c.rope_theta == 1e6 and c.rope_scaling == {"factor": 4.0, "rope_type": "linear"}
    assert c.local_rope_theta == 10000.0 and c.qk_norm and c.attn_logit_softcap is None


def test_layer_pattern_without_layer_types():
    """Without `layer_types`, every pattern-th layer is global: 2 for Gemma 2, sliding_window_pattern for Gemma 3."""
    cfg = json.loads((FIXTURES / "gemma2_softcap" / "config_legacy.json").read_text())
    cfg["num_hidden_layers"] = 5
    assert ModelConfig.from_hf_dict(cfg).layer_types == (SLIDING, FULL, SLIDING, FULL, SLIDING)
    cfg = json.loads((FIXTURES / "gemma3_text" / "config_legacy.json").read_text())
    cfg.update(num_hidden_layers=7, sliding_window_pattern=3)
    assert ModelConfig.from_hf_dict(cfg).layer_types == (SLIDING, SLIDING, FULL) * 2 + (SLIDING,)


def test_multimodal_gemma3_serves_its_language_model():
    """A `gemma3` checkpoint's text_config names only what differs from Gemma3TextConfig's defaults."""
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    c = ModelConfig.from_hf_dict(cfg)
    assert c.model_type == "gemma3_text" and c.torch_dtype == "bfloat16"
    assert (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == (262_208, 8, 4, 256)
    assert c.layer_types[:6] == (SLIDING,) * 5 + (FULL,) and c.layer_window(0) == 1024
    assert c.local_rope_theta == 10_000.0 and c.rope_scaling["factor"] == 8.0 and c.attn_scale == 256 ** -0.5


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention"]}, "layer_types must list 4"),
    ({"layer_types": ["local"] * 4}, "layer_types must list 4"),
    ({"hidden_activation": "relu"}, "unsupported hidden activation"),
    ({"sliding_window": None}, "sliding_window is not set"),
])
def test_bad_family_configs_are_refused_by_name(change, message):
    cfg = {**json.loads((FIXTURES / "gemma2_softcap" / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(cfg)


def _stages(num_layers: int, pp: int) -> SimpleNamespace:
    """What `check_stage_pattern` reads of a MeshPlan, without the devices a real pipeline needs."""
    per = -(-num_layers // pp)
    at = lambda stage, slot: stage * per + slot if stage * per + slot < num_layers else None
    return SimpleNamespace(pp=pp, layers_per_stage=per, layer_at=at)


def test_pipeline_stages_must_repeat_the_layer_pattern():
    """Every stage runs one graph: layer slot j must be one kind of layer on all stages."""
    gemma2 = _config("gemma2_softcap")  # S F S F: two stages of (S, F) repeat it
    check_stage_pattern(gemma2, _stages(4, 2))
    assert gemma2.first_layers(2).layer_types == (SLIDING, FULL)
    check_stage_pattern(_config("gemma3_text"), _stages(6, 1))
    with pytest.raises(ValueError, match="layers \\[2, 5\\] in one slot"):
        check_stage_pattern(_config("gemma3_text"), _stages(6, 2))  # S S S | S S F


def test_moe_configs():
    q = _config("qwen3_moe")
    assert q.sparse_layers == (True, False, True)  # mlp_only_layers [1]
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.intermediate_size) == (8, 2, 16, 96)
    assert q.norm_topk_prob and q.qk_norm and q.sliding_window is None
    m = _config("mixtral")
    assert m.sparse_layers == (True, True) and m.norm_topk_prob and m.moe_intermediate_size == 16
    assert [m.layer_window(i) for i in range(2)] == [20, 20]
    cfg = json.loads((FIXTURES / "qwen3_moe" / "config_legacy.json").read_text())
    cfg.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[])
    assert ModelConfig.from_hf_dict(cfg).sparse_layers == (False, True, False, True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**cfg, "num_experts_per_tok": 9})


@pytest.mark.parametrize("method, tile, split", [
    ("tiled", None, False), ("tiled", 1, False), ("tiled", 4, False), ("tiled", 32, False), ("tiled", 128, False),
    ("ragged_dot", None, False), ("tiled", None, True), ("tiled", 4, True), ("tiled", 128, True)])
def test_grouped_ffn_matches_each_expert_applied_alone(method, tile, split):
    """Segments of every size: empty experts, one spanning several tiles, tiles reaching into the next
    expert's rows and past the last row, one tile taller than all the rows; with the experts stacked and
    held as separate arrays (`SplitExperts`: each tile's expert picked by lax.switch)."""
    rng = np.random.default_rng(0)
    sizes = np.array([0, 5, 70, 1, 0, 33, 2, 9], np.int32)
    hidden, inter = 16, 8
    rows = jnp.asarray(rng.normal(size=(sizes.sum(), hidden)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(8, hidden, inter)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(8, inter, hidden)), jnp.float32)
    weights = (w_gate, w_up, w_down) if not split else (  # gate and up side by side, as SplitExperts holds them
        tuple(jnp.concatenate([w_gate[e], w_up[e]], axis=-1) for e in range(8)), None, tuple(w_down))
    got = grouped_ffn(rows, jnp.asarray(sizes), *weights, jax.nn.silu, method, tile)
    expert = np.repeat(np.arange(8), sizes)
    want = jnp.einsum("ai,aih->ah", jax.nn.silu(jnp.einsum("ah,ahi->ai", rows, w_gate[expert]))
                      * jnp.einsum("ah,ahi->ai", rows, w_up[expert]), w_down[expert])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4)


def test_split_experts_run_only_in_the_tiled_loop():
    gate_up, down = tuple(jnp.zeros((4, 4)) for _ in range(3)), tuple(jnp.zeros((2, 4)) for _ in range(3))
    with pytest.raises(ValueError, match="tiled loop"):
        grouped_ffn(jnp.zeros((3, 4)), jnp.asarray([3, 0, 0]), gate_up, None, down, jax.nn.silu, "ragged_dot")


def test_split_experts_replace_the_stacks_with_each_experts_arrays():
    """`split_experts` holds expert e's weights as arrays of their own, equal to the stacks' rows e (gate and up
    side by side), and the layer computes what it computed stacked."""
    config = ModelConfig.from_pretrained(FIXTURES / "qwen3_moe")
    model = random_model(config, jnp.float32, seed=0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, config.hidden_size)), jnp.float32)
    sparse = [i for i, s in enumerate(config.sparse_layers) if s]
    layer = model.layers[sparse[0]]
    moe = getattr(layer, layer.ffn_name)
    before, stacks = moe(x), moe.experts.weights()
    split_experts(model)
    assert isinstance(moe.experts, SplitExperts) and len(moe.experts.each) == config.num_experts
    (gate, up, down), (gate_up, no_up, down_each) = stacks, moe.experts.weights()
    assert no_up is None and len(gate_up) == len(down_each) == config.num_experts
    for e in range(config.num_experts):
        np.testing.assert_array_equal(gate_up[e], np.concatenate([gate[e], up[e]], axis=-1))
        np.testing.assert_array_equal(down_each[e], down[e])
    np.testing.assert_allclose(moe(x), before, rtol=1e-5, atol=1e-6)


def test_tile_rows_follow_the_rows_an_expert_gets():
    # top 8 of 64: one row per tile up to 8 tokens, then twice the average segment (1 to 512 tokens)
    assert [tile_rows(a, 64) for a in (8, 64, 128, 256, 512, 4096)] == [1, 1, 4, 8, 16, 32]
    assert tile_rows(120, 8) == 32 and tile_rows(1, 8) == 1 and tile_rows(24, 8) == 8


def test_routed_ffn_weights_and_adds_back_each_tokens_experts():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)
    experts = jnp.asarray([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1], [1, 2]], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(6, 2)), jnp.float32)
    ffn = lambda e, v: (jax.nn.silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]
    want = jnp.stack([sum(weights[n, j] * ffn(int(experts[n, j]), x[n]) for j in range(2)) for n in range(6)])
    np.testing.assert_allclose(routed_ffn(x, weights, experts, w_gate, w_up, w_down, jax.nn.silu), want,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["tiled", "ragged_dot"])
def test_expert_parallel_shares_add_up_to_all_experts(method):
    """Each device of an expert-parallel group runs only its experts; the all-reduce's sum is the whole."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(5, 4)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(4, 4, 3)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(4, 3, 4)), jnp.float32)
    experts = jnp.asarray([[0, 3], [1, 2], [3, 1], [2, 0], [1, 3]], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(5, 2)), jnp.float32)
    whole = routed_ffn(x, weights, experts, w_gate, w_up, w_down, jax.nn.silu, method)
    shares = [routed_ffn(x, weights, experts, w_gate[i:i + 2], w_up[i:i + 2], w_down[i:i + 2], jax.nn.silu, method,
                         num_experts=4, first_expert=i) for i in (0, 2)]
    np.testing.assert_allclose(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-5)


# Gemma-style templates (written for this test): turns are `user` / `model`; one folds a system message
# into the first user turn, as Gemma 3's does, the other refuses it, as Gemma 2's does.
FOLDING = ("{{ bos_token }}{% set sys = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' "
           "else '' %}{% for m in messages if m['role'] != 'system' %}<start_of_turn>"
           "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ sys if loop.first else '' }}"
           "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
           "{% endif %}")
REFUSING = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"


def test_a_system_message_goes_where_the_checkpoints_template_puts_it(stories_dir):
    from jaxserve.text.chat_template import ChatTemplateError
    from jaxserve.text.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(stories_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, chat_template=FOLDING) == (
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ChatTemplateError, match="System role not supported"):  # the server's 400
        tok.apply_chat_template(messages, chat_template=REFUSING)


def test_a_mixture_quantized_at_load_keeps_its_router_in_float():
    """--quantization int8 on a mixture quantizes its attention projections and keeps the router float (a
    sliver of the bytes, and its rounding would move tokens between experts); every parameter has a partition
    rule, so the model places on a mesh (a quantized router had none and failed to load)."""
    from jaxserve.loader.abstract import AbstractModel
    from jaxserve.loader.quantized import QuantizationFlags, quantized_config
    from jaxserve.model.quantized_linear import QuantizedLinear
    from jaxserve.model.registry import abstract_model
    from sharding import ParallelConfig, make_plan

    config = quantized_config(ModelConfig.from_pretrained(FIXTURES / "qwen3_moe"), QuantizationFlags("int8"))
    model = abstract_model(config, jnp.float32)
    sparse = model.layers[0].mlp
    assert type(sparse.gate).__name__ == "Linear" and isinstance(model.layers[0].self_attn.q_proj, QuantizedLinear)
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    paths = {"/".join(e.path) for e in AbstractModel(config, jnp.float32, plan).entries}
    assert "layers/0/mlp/gate/kernel" in paths and "layers/0/self_attn/q_proj/codes" in paths
