"""`jaxserve convert --format mapped`: safetensors in the model's own layout, every tensor 64-byte aligned,
loaded in place from the memory-mapped files (on CPU the device arrays are the file's pages)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.loader.formats import Checkpoint, MARKER
from jaxserve.entrypoints.cli import main as cli_main
from jaxserve.config import ModelConfig
from jaxserve.loader.load import load_sharded
from jaxserve.loader.load import load_model
from jaxserve.loader.safetensors import read_header
from sharding import ParallelConfig, make_plan


@pytest.fixture(scope="module")
def mapped(mapped_stories_dir):
    return mapped_stories_dir


def _plan(config):
    return make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)


def _host_params(model):
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(model.params)}


def test_convert_writes_aligned_safetensors_in_the_models_layout(mapped):
    assert Checkpoint.read(mapped).format == "mapped" and (mapped / MARKER).is_file()
    assert (mapped / "config.json").is_file() and (mapped / "tokenizer.json").is_file()
    data_start, tensors = read_header(mapped / "model.safetensors")
    assert data_start % 64 == 0
    assert all(info["data_offsets"][0] % 64 == 0 for info in tensors.values())
    assert tensors["layers.0.mlp.gate_proj.kernel"]["shape"] == [64, 172]  # [in, out], by parameter path
    from safetensors import safe_open
    with safe_open(mapped / "model.safetensors", "np") as f:
        assert set(f.keys()) == set(tensors)
        np.testing.assert_array_equal(f.get_tensor("norm.weight"),
                                      np.frombuffer((mapped / "model.safetensors").read_bytes(), np.float32,
                                                    64, data_start + tensors["norm.weight"]["data_offsets"][0]))


def _odd_sized_hf_checkpoint(directory) -> None:
    """A random Llama whose tensor sizes are not multiples of 64 bytes (hidden 24, vocab 50), written as
    Hugging Face safetensors."""
    import json
    import shutil

    from flax import nnx
    from safetensors.numpy import save_file

    from jaxserve.loader.safetensors import hf_tensor_name
    from jaxserve.loader.tree import flatten
    from jaxserve.model.registry import random_model
    fixture = Path(__file__).parent / "fixtures" / "parity" / "llama_gqa_untied"
    config = json.loads((fixture / "config.json").read_text()) | {
        "hidden_size": 24, "head_dim": 12, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 40, "vocab_size": 50, "num_hidden_layers": 2}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    shutil.copy(fixture / "generation_config.json", directory)
    module = random_model(ModelConfig.from_pretrained(directory), jnp.float32, seed=3)
    tensors = {}
    for path, value in flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param))):
        name, transpose = hf_tensor_name(path)
        tensors[name] = np.ascontiguousarray(np.asarray(value).T if transpose else np.asarray(value))
    save_file(tensors, directory / "model.safetensors")


def test_odd_sizes_are_padded_and_a_big_model_spans_files(tmp_path, monkeypatch):
    from jaxserve.loader import mapped
    from jaxserve.loader.convert import convert
    hf = tmp_path / "hf"
    _odd_sized_hf_checkpoint(hf)
    monkeypatch.setattr(mapped, "MAPPED_SHARD_BYTES", 8 << 10)  # a few tensors per file
    convert(hf, tmp_path / "mapped", "float32", format="mapped")
    files = sorted((tmp_path / "mapped").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "mapped" / "model.safetensors.index.json").is_file()
    pads = 0
    for file in files:
        data_start, tensors = read_header(file)
        assert data_start % 64 == 0
        assert all(t["data_offsets"][0] % 64 == 0 for name, t in tensors.items() if not name.startswith("__pad__."))
        pads += sum(name.startswith("__pad__.") for name in tensors)
    assert pads  # a 24-float norm is 96 bytes: a padding tensor follows it
    config = ModelConfig.from_pretrained(hf)
    a = _host_params(load_sharded(tmp_path / "mapped", config, jnp.float32, _plan(config)))
    b = _host_params(load_sharded(hf, config, jnp.float32, _plan(config)))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _mapped_ranges(path) -> list[tuple[int, int]]:
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((begin, end))
    return ranges


def test_mapped_checkpoint_loads_in_place_with_the_same_params(stories_dir, mapped):
    config = ModelConfig.from_pretrained(stories_dir)
    from_mapped = load_sharded(mapped, config, jnp.float32, _plan(config))
    from_hf = load_sharded(stories_dir, config, jnp.float32, _plan(config))
    a, b = _host_params(from_mapped), _host_params(from_hf)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # No copy on CPU: every parameter's device buffer lies in the file's mapping.
    ranges = _mapped_ranges(mapped / "model.safetensors")
    assert ranges
    for leaf in jax.tree.leaves(from_mapped.params):
        pointer = leaf.addressable_shards[0].data.unsafe_buffer_pointer()
        assert any(begin <= pointer < end for begin, end in ranges), leaf.shape


def test_another_dtype_than_the_stored_one_is_converted_on_load(stories_dir, mapped):
    config = ModelConfig.from_pretrained(stories_dir)
    half = load_sharded(mapped, config, jnp.bfloat16, _plan(config))
    reference = load_sharded(stories_dir, config, jnp.bfloat16, _plan(config))
    for x, y in zip(jax.tree.leaves(half.params), jax.tree.leaves(reference.params)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_load_model_reads_a_mapped_checkpoint(stories_dir, mapped):
    config = ModelConfig.from_pretrained(stories_dir)
    from flax import nnx
    a = nnx.to_pure_dict(nnx.state(load_model(mapped, config, jnp.float32), nnx.Param))
    b = nnx.to_pure_dict(nnx.state(load_model(stories_dir, config, jnp.float32), nnx.Param))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_convert_refuses_a_directory_that_is_not_empty(stories_dir, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "--model", str(stories_dir), "--output", str(tmp_path / "taken"), "--format", "mapped"])
    assert exit_info.value.code == 2
