"""Loading Hugging Face checkpoints: single file, sharded index, dtypes, and clear errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.weights import load_model, resolve_dtype


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
