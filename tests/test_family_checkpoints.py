"""Checkpoints of the issue-29 families: experts stacked at load from per-expert Hugging Face tensors, the
same parameters from the mapped and Orbax formats, and a multimodal Gemma 3's language model served with
its vision tower skipped by name."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.loader.convert import convert
from jaxserve.loader.load import load_sharded
from sharding import ParallelConfig, make_plan

FIXTURES = Path(__file__).parent / "fixtures" / "parity"


def _load(directory: Path, config: ModelConfig) -> dict[str, np.ndarray]:
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(directory, config, jnp.float32, plan)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
            jax.tree_util.tree_leaves_with_path(model.params)}


@pytest.mark.parametrize("case, block, names", [("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
                                                ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"))])
def test_experts_are_stacked_at_load_and_survive_conversion(tmp_path, case, block, names):
    config = ModelConfig.from_pretrained(FIXTURES / case)
    hf = _load(FIXTURES / case, config)
    raw = load_file(FIXTURES / case / "model.safetensors")
    for name in names:  # [E, in, out] from E tensors [out, in]
        stacked = hf[f"['layers'][0]['{block}']['experts']['{name}'].value"]
        want = np.stack([raw[f"model.layers.0.{block}.experts.{e}.{name}.weight"].T for e in range(8)])
        np.testing.assert_array_equal(stacked, want)
    router = hf[f"['layers'][0]['{block}']['gate']['kernel'].value"]
    np.testing.assert_array_equal(router, raw[f"model.layers.0.{block}.gate.weight"].T)
    for fmt in ("mapped", "orbax"):
        other = _load(convert(FIXTURES / case, tmp_path / fmt, "float32", format=fmt), config)
        assert other.keys() == hf.keys()
        for key in hf:
            np.testing.assert_array_equal(other[key], hf[key], err_msg=f"{fmt}: {key}")


def _multimodal(directory: Path, prefix: str, extra: dict[str, np.ndarray]) -> None:
    """gemma3_text_hd256 dressed as a `gemma3` checkpoint: text_config, prefixed names, vision tensors."""
    source = FIXTURES / "gemma3_text_hd256"
    directory.mkdir()
    text = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text,
                                                       "vision_config": {"model_type": "siglip_vision_model"}}))
    shutil.copy(source / "generation_config.json", directory)
    tensors = {prefix + name.removeprefix("model."): value
               for name, value in load_file(source / "model.safetensors").items()}
    save_file(tensors | extra, directory / "model.safetensors")


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_multimodal_gemma3_loads_its_language_model_and_skips_the_vision_tower(tmp_path, prefix):
    vision = {"vision_tower.vision_model.embeddings.patch_embedding.weight": np.ones((4, 3), np.float32),
              "multi_modal_projector.mm_input_projection_weight": np.ones((2, 2), np.float32)}
    _multimodal(tmp_path / "mm", prefix, vision)
    config = ModelConfig.from_pretrained(tmp_path / "mm")
    assert config == ModelConfig.from_pretrained(FIXTURES / "gemma3_text_hd256")
    got, want = _load(tmp_path / "mm", config), _load(FIXTURES / "gemma3_text_hd256", config)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_tensor_of_no_known_part_is_refused_by_name(tmp_path):
    _multimodal(tmp_path / "mm", "model.language_model.", {"audio_tower.weight": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="audio_tower.weight"):
        _load(tmp_path / "mm", ModelConfig.from_pretrained(tmp_path / "mm"))
