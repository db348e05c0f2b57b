"""A mapped checkpoint stored feature-major (`jaxserve convert --format mapped --linear-layout feature-major`,
jaxserve/loader/turned.py): the turned parameters are what the engine's own turning makes, a CPU engine
uses them where they lie in the file, and every other engine reads them turned back, with the same tokens."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.entrypoints.cli import main as cli_main
from jaxserve.loader import placement
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.convert import convert
from jaxserve.loader.formats import MARKER, Checkpoint
from jaxserve.loader.load import load_model, load_weights
from jaxserve.loader.quantized import QuantizationFlags
from jaxserve.loader.safetensors import read_header
from jaxserve.loader.turned import TurningReader, UnturningReader, turned_parts
from sharding import ParallelConfig, make_plan
from tests.test_parity import FIXTURES

PROMPTS = ["Once upon a time", "The little dog ran to the"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ENGINE = dict(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=16, token_buckets=(16,))


def _host_params(model) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(model.params)}


def _checkpoint(case: str, quantization: str | None):
    """The parity fixture's Hugging Face reader, quantized at load if asked, and the config to load it with."""
    checkpoint = Checkpoint.read(FIXTURES / case)
    config = checkpoint.served_config(ModelConfig.from_pretrained(FIXTURES / case), QuantizationFlags(quantization))
    return lambda: (checkpoint.reader(AbstractModel(config, jnp.float32)), config)


@pytest.mark.parametrize("case, quantization", [("qwen2_bias", None), ("llama_gqa_untied", "int8"),
                                                ("qwen3_moe", None)])
def test_the_stored_turning_is_the_engines_turning_and_turns_back(case, quantization):
    """q/k/v biases fused with their weights, an untied LM head, int8 codes turned, a router turned beside
    experts left as they are: read through `TurningReader`, every parameter equals what
    `placement.feature_major` makes of the model loaded as it is; read back through `UnturningReader`,
    every parameter equals the model's own."""
    checkpoint = _checkpoint(case, quantization)
    config = checkpoint()[1]
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    own = load_weights(checkpoint()[0], AbstractModel(config, jnp.float32, plan))
    own_params = _host_params(own)
    by_engine = placement.feature_major(own)
    by_reader = load_weights(TurningReader(checkpoint()[0], config, jnp.float32),
                             AbstractModel(config, jnp.float32, plan, feature_major=True))
    assert by_reader.feature_major and by_reader.graphdef == by_engine.graphdef
    expected = _host_params(by_engine)
    got = _host_params(by_reader)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    parts = turned_parts(config, jnp.float32)
    if quantization:  # quantized layers keep their products apart, codes turned
        assert any(p[0].transposed and p[0].source[-1] == "codes" for p in parts.values())
    else:
        assert any(len(p) == 3 for p in parts.values())  # q/k/v fused
    turned_module = nnx.merge(by_reader.graphdef, by_reader.params)
    back = load_weights(UnturningReader(placement.ModuleReader(turned_module), config, jnp.float32),
                        AbstractModel(config, jnp.float32, plan))
    back_params = _host_params(back)
    assert back_params.keys() == own_params.keys()
    for name in own_params:
        np.testing.assert_array_equal(back_params[name], own_params[name], err_msg=name)


@pytest.fixture(scope="module")
def turned_stories(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("turned") / "stories260K-feature-major"
    assert cli_main(["convert", "--model", str(stories_dir), "--output", str(out), "--format", "mapped",
                     "--linear-layout", "feature-major"]) == 0
    return out


@pytest.fixture(scope="module")
def stories_tokens(stories_dir):
    llm = LLM(str(stories_dir), **ENGINE)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_convert_stores_the_layers_turned_and_says_so(turned_stories):
    assert json.loads((turned_stories / MARKER).read_text())["linear_layout"] == "feature-major"
    data_start, tensors = read_header(turned_stories / "model.safetensors")
    assert data_start % 64 == 0 and all(t["data_offsets"][0] % 64 == 0 for t in tensors.values())
    # q, k, v (64 + 32 + 32 outputs) as one [out, in] weight; gate and up (172 each); o and down on their own
    assert tensors["layers.0.self_attn.fused_projections.weight"]["shape"] == [128, 64]
    assert tensors["layers.0.mlp.fused_projections.weight"]["shape"] == [344, 64]
    assert tensors["layers.0.mlp.down_proj.weight"]["shape"] == [64, 172]
    assert not any(name.endswith("kernel") for name in tensors)


@pytest.mark.parametrize("layer_loop", ["unroll", "scan"])
def test_a_cpu_engine_uses_the_turned_layers_where_they_lie(turned_stories, stories_tokens, layer_loop, caplog):
    """Unrolled, the device arrays are the file's pages; under `lax.scan` the turned layers are stacked."""
    with caplog.at_level("INFO"):
        llm = LLM(str(turned_stories), cpu_matmul_library="ynnpack-feature-major", layer_loop=layer_loop, **ENGINE)
    assert "stored so by `jaxserve convert`, used where they lie" in caplog.text
    assert "turned to [out, in]" not in caplog.text
    size = sum(a.nbytes for a in jax.tree.leaves(llm.engine.runner.params)) / 1e6
    assert f"(mapped safetensors, {size:.1f} MB in place)" in caplog.text  # every weight, no copy
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == stories_tokens
    assert llm.engine.compilations_since_warmup == 0


@pytest.mark.parametrize("library", ["ynnpack", "eigen"])
def test_other_engines_read_the_turned_layers_turned_back(turned_stories, stories_tokens, library, caplog):
    """The engines a GPU or a mesh would build too: the model's own layout, read from the turned file."""
    with caplog.at_level("INFO"):
        llm = LLM(str(turned_stories), cpu_matmul_library=library, **ENGINE)
    assert "turned back from the feature-major layout" in caplog.text
    names = ["/".join(map(str, path)) for path, _ in nnx.to_flat_state(llm.engine.runner.params)]
    assert "layers/0/self_attn/q_proj/kernel" in names
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == stories_tokens


def test_a_notebook_loads_the_model_in_its_own_layout(turned_stories, stories_dir):
    config = ModelConfig.from_pretrained(stories_dir)
    turned_back, own = load_model(turned_stories, config, jnp.float32), load_model(stories_dir, config, jnp.float32)
    np.testing.assert_array_equal(np.asarray(turned_back.layers[0].self_attn.k_proj.kernel[...]),
                                  np.asarray(own.layers[0].self_attn.k_proj.kernel[...]))


def test_the_layout_is_chosen_for_the_cpu_and_refused_where_it_cannot_be(stories_dir, tmp_path):
    # stories260K (hidden 64) runs its products as they are: `auto` keeps the model's own layout
    convert(stories_dir, tmp_path / "auto", format="mapped")
    assert "linear_layout" not in json.loads((tmp_path / "auto" / MARKER).read_text())
    with pytest.raises(ValueError, match="--format mapped only"):
        convert(stories_dir, tmp_path / "orbax", format="orbax", linear_layout="feature-major")
    with pytest.raises(ValueError, match="linear_layout must be one of"):
        convert(stories_dir, tmp_path / "bad", format="mapped", linear_layout="columns")


def test_a_turned_float_checkpoint_quantized_at_load_is_turned_back_first(turned_stories, stories_dir):
    """`--quantization int8` on a float checkpoint stored turned: the quantizer reads the kernels turned back
    ([in, out]), and a feature-major engine turns its codes again at start; the tokens are those of the
    Hugging Face directory quantized at load."""
    int8 = dict(ENGINE, quantization="int8", cpu_matmul_library="ynnpack-feature-major")
    from_turned, from_hf = LLM(str(turned_stories), **int8), LLM(str(stories_dir), **int8)
    assert from_turned.engine.precision.linear_codes == "int8"
    assert ([o.outputs[0].token_ids for o in from_turned.generate(PROMPTS, GREEDY)] ==
            [o.outputs[0].token_ids for o in from_hf.generate(PROMPTS, GREEDY)])
