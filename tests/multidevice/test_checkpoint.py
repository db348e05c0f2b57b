"""An Orbax checkpoint written under tp 2 restores under tp 4 (and tp 4 x pp 2) and under one device,
straight into those meshes' shardings, with identical parameters and outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loader.formats import MARKER
from jaxserve.loader.orbax import PARAMS_DIR
from jaxserve.entrypoints.cli import main as cli_main
from jaxserve.config import ModelConfig
from jaxserve.loader.load import load_sharded
from sharding import ParallelConfig, make_plan
from tests.multidevice.test_mesh import ENGINE

PROMPTS = ["Once upon a time", "", "The cat sat on"]


@pytest.fixture(scope="module")
def converted(stories_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "stories260K-orbax"
    assert cli_main(["convert", "--model", str(stories_dir), "--output", str(out), "--tensor-parallel-size", "2"]) == 0
    return out


def test_convert_writes_orbax_params_config_and_tokenizer(converted):
    assert (converted / MARKER).is_file()
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (converted / name).is_file()
    assert not list(converted.glob("*.safetensors"))
    meta = ocp.PyTreeCheckpointer().metadata(converted / PARAMS_DIR)
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    q = tree["layers"]["0"]["self_attn"]["q_proj"]["kernel"]
    assert tuple(q.shape) == (64, 64)  # the model's own per-layer shape, not a mesh's
    assert int(np.prod(q.sharding.shape)) == 2  # written from a tp 2 mesh
    mlp = tree["layers"]["0"]["mlp"]["gate_proj"]["kernel"]
    assert tuple(mlp.shape) == (64, 172)  # true shape: 172 splits 2 ways, nothing padded


def _host_params(model):
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(model.params)}


def _assert_loads_like_safetensors(model_dir, stories_dir, tp: int, pp: int) -> None:
    config = ModelConfig.from_pretrained(stories_dir)
    plan = make_plan(ParallelConfig(tp, pp), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    converted = load_sharded(model_dir, config, jnp.float32, plan)
    from_hf = load_sharded(stories_dir, config, jnp.float32, plan)
    for a, b in zip(jax.tree.leaves(converted.params), jax.tree.leaves(from_hf.params)):
        assert a.sharding == b.sharding
    a, b = _host_params(converted), _host_params(from_hf)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("tp, pp", [(4, 1), (4, 2), (8, 1), (1, 1)])
def test_restored_params_equal_safetensors_load(stories_dir, converted, tp, pp):
    _assert_loads_like_safetensors(converted, stories_dir, tp, pp)


def test_restored_checkpoint_generates_the_same_tokens(stories_dir, converted):
    params = SamplingParams(temperature=0, max_tokens=40)
    # The engine shape of test_mesh.py: its step programs come from the run's program cache, whichever runs first.
    reference = [o.outputs[0].token_ids for o in LLM(str(stories_dir), **ENGINE).generate(PROMPTS, params)]
    for tp in (4, 1):
        llm = LLM(str(converted), **ENGINE, tensor_parallel_size=tp)
        assert llm.engine.model_name == converted.name
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == reference


@pytest.fixture(scope="module")
def mapped(mapped_stories_dir):
    return mapped_stories_dir


@pytest.mark.parametrize("tp, pp", [(4, 2), (2, 1)])
def test_mapped_checkpoint_loads_on_a_mesh_like_safetensors(stories_dir, mapped, tp, pp):
    """Tensor-parallel slices of a mapped checkpoint: a kernel split by columns is copied, one split by rows
    (or replicated) is used in place; either way every shard equals the Hugging Face load."""
    _assert_loads_like_safetensors(mapped, stories_dir, tp, pp)


@pytest.mark.parametrize("tp, pp", [(4, 2), (2, 1)])
def test_a_feature_major_mapped_checkpoint_loads_on_a_mesh_turned_back(stories_dir, tmp_path_factory, tp, pp):
    """A mapped checkpoint stored turned on a CPU (jaxserve/loader/turned.py) still serves a mesh: every shard
    is read from the fused [out, in] tensors and turned back, equal to the Hugging Face load."""
    from jaxserve.loader.convert import convert
    out = convert(stories_dir, tmp_path_factory.mktemp("turned") / "fm", format="mapped",
                  linear_layout="feature-major")
    _assert_loads_like_safetensors(out, stories_dir, tp, pp)


def test_mapped_checkpoint_shards_split_by_rows_are_the_files_pages(stories_dir, mapped):
    config = ModelConfig.from_pretrained(stories_dir)
    plan = make_plan(ParallelConfig(2, 1), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(mapped, config, jnp.float32, plan)
    ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in open("/proc/self/maps")
              if line.rstrip().endswith(str(mapped / "model.safetensors"))]

    def in_file(array) -> list[bool]:
        return [any(a <= s.data.unsafe_buffer_pointer() < b for a, b in ranges) for s in array.addressable_shards]

    layers = model.params["layers"][0]  # the first layer slot (with pipeline parallel 1: layer 0)
    assert all(in_file(layers["self_attn"]["o_proj"]["kernel"][...]))  # rows of [in, out]: contiguous
    assert not any(in_file(layers["self_attn"]["q_proj"]["kernel"][...]))  # columns: copied


@pytest.mark.parametrize("fmt", ["orbax", "mapped"])
def test_moe_checkpoints_restore_under_tensor_and_expert_parallel_meshes(tmp_path, fmt):
    """Stacked experts written from an expert-parallel mesh restore into slices of every expert (tp 4),
    whole experts (tp 4 with expert parallelism) and two stages (layers 0 and 2, both sparse, share a slot),
    equal to a safetensors load there."""
    from pathlib import Path
    from jaxserve.loader.convert import convert
    source = Path(__file__).resolve().parents[1] / "fixtures" / "parity" / "qwen3_moe"
    out = convert(source, tmp_path / fmt, "float32", ParallelConfig(2, 1, enable_expert_parallel=True), format=fmt)
    config = ModelConfig.from_pretrained(source)
    for parallel in (ParallelConfig(4, 1), ParallelConfig(4, 1, enable_expert_parallel=True), ParallelConfig(2, 2)):
        plan = make_plan(parallel, num_layers=3, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads)
        restored, from_hf = load_sharded(out, config, jnp.float32, plan), load_sharded(source, config, jnp.float32, plan)
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(from_hf.params)):
            assert a.sharding == b.sharding
        a, b = _host_params(restored), _host_params(from_hf)
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{parallel}: {key}")
