"""Loading Hugging Face checkpoints: single file, sharded index, dtypes, and clear errors."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.loader.dtypes import resolve_dtype
from jaxserve.loader.load import load_model
from jaxserve.loader.safetensors import copy_transposed, SafetensorsFile, SafetensorsReader
from sharding.loading import SMALL_PAGES_FROM, host_buffer


def _copy_config(src, dst):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model))


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_sharded_index_loads_the_same_weights(stories_dir, tmp_path):
    tensors = load_file(stories_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, tmp_path / file)
    weight_map = {n: f for f, part in halves.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _copy_config(stories_dir, tmp_path)
    config = ModelConfig.from_pretrained(stories_dir)
    single, sharded = load_model(stories_dir, config, jnp.float32), load_model(tmp_path, config, jnp.float32)
    for a, b in zip(_leaves(_params(single)), _leaves(_params(sharded))):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_load_casts_every_parameter(stories_dir):
    model = load_model(stories_dir, ModelConfig.from_pretrained(stories_dir), jnp.bfloat16)
    assert {x.dtype for x in jax.tree_util.tree_leaves(_params(model))} == {jnp.dtype(jnp.bfloat16)}


def test_missing_tensor_is_named(stories_dir, tmp_path):
    tensors = load_file(stories_dir / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    _copy_config(stories_dir, tmp_path)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), jnp.float32)


def test_shape_mismatch_is_named(stories_dir, tmp_path):
    tensors = load_file(stories_dir / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(63, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    _copy_config(stories_dir, tmp_path)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(63,\).*\(64,\)"):
        load_model(tmp_path, ModelConfig.from_pretrained(tmp_path), jnp.float32)


def test_unsupported_model_type_lists_the_supported_ones(stories_dir):
    cfg = json.loads((stories_dir / "config.json").read_text()) | {"model_type": "gpt2"}
    with pytest.raises(ValueError, match="gpt2.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict(cfg)


def test_dtype_resolution(stories_dir):
    config = ModelConfig.from_pretrained(stories_dir)
    assert resolve_dtype("auto", config, platform="cpu") == jnp.float32
    assert resolve_dtype("auto", config, platform="gpu") == jnp.float32  # the checkpoint is float32
    assert resolve_dtype("bfloat16", config) == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", config)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int64"])
def test_memory_mapped_views_match_the_safetensors_package(tmp_path, dtype):
    rng = np.random.default_rng(0)
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    tensors = {"a": (rng.standard_normal((37, 70)) * 8).astype(np_dtype), "b": np.arange(5, dtype=np_dtype),
               "scalar": np.array(3, np_dtype)}
    save_file(tensors, tmp_path / "t.safetensors")
    file = SafetensorsFile(tmp_path / "t.safetensors")
    for name, expected in load_file(tmp_path / "t.safetensors").items():
        view = file.view(name)
        assert view.dtype == expected.dtype and view.shape == expected.shape
        assert view.tobytes() == expected.tobytes()
        del view
        file.release(name)
    file.close()


@pytest.mark.parametrize("shape", [(1, 1), (63, 65), (200, 130), (64, 64)])
def test_tiled_transpose_with_dtype_conversion(shape):
    source = np.random.default_rng(1).standard_normal(shape).astype(ml_dtypes.bfloat16)
    out = np.empty(shape[::-1], np.float32)
    copy_transposed(out, source)
    np.testing.assert_array_equal(out, source.T.astype(np.float32))


def test_reader_fills_transposed_regions_of_a_linear_kernel(stories_dir):
    """Each device's slice of an [in, out] kernel (HF stores [out, in]), from the memory-mapped file."""
    stored = load_file(stories_dir / "model.safetensors")["model.layers.0.mlp.gate_proj.weight"]  # [out, in]
    kernel = stored.T
    reader = SafetensorsReader(stories_dir)
    fill = reader.reader(("layers", "0", "mlp", "gate_proj", "kernel"), kernel.shape)
    for index in [(slice(None), slice(None)), (slice(0, 16), slice(32, 96)), (slice(40, 64), slice(0, 8))]:
        out = host_buffer(kernel[index].shape, np.float32)
        fill(index, out)
        np.testing.assert_array_equal(out, kernel[index])
    reader.close()


def test_host_buffers_are_aligned_for_zero_copy_device_arrays():
    for shape in [(3,), (17, 5), (2048, 64), (1024, 1025)]:  # the last is over SMALL_PAGES_FROM: a mapping
        buffer = host_buffer(shape, np.float32)
        assert buffer.ctypes.data % 64 == 0 and buffer.shape == shape and buffer.flags.c_contiguous
        assert buffer.flags.writeable
    if jax.default_backend() == "cpu":  # XLA:CPU adopts the buffer: one copy of the weights, not two
        for shape in [(256, 256), (1024, 1025)]:
            buffer = host_buffer(shape, np.float32)
            buffer[...] = 1.0
            device = jax.device_put(buffer)
            assert np.shares_memory(np.asarray(device), buffer)
            del buffer  # the device array keeps the memory (for a mapping: the mapping) alive
            assert float(device[-1, -1]) == 1.0 and float(device.sum()) == np.prod(shape)


def _vma_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_large_host_buffers_are_mapped_in_small_pages():
    """numpy asks for transparent huge pages above 4 MiB; loading buffers opt out (see host_buffer)."""
    large = host_buffer((SMALL_PAGES_FROM // 4,), np.float32)
    assert "nh" in _vma_flags(large.ctypes.data)


@pytest.mark.parametrize("head", [(2**62).to_bytes(8, "little"), (0).to_bytes(8, "little"),
                                  (9).to_bytes(8, "little") + b"{not json"])
def test_a_corrupt_safetensors_header_is_a_clear_error(tmp_path, head):
    path = tmp_path / "model.safetensors"
    path.write_bytes(head + bytes(64))
    with pytest.raises(ValueError, match="safetensors"):
        SafetensorsFile(path)
