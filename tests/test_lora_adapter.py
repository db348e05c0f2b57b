"""Reading PEFT adapters (no device): what is taken from adapter_config.json, and each refusal names the file
and the reason."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.config import ModelConfig
from jaxserve.engine_args import parse_lora_module
from jaxserve.lora.adapter import LoRAError, load_adapter
from tests.lora_model import LORA

CONFIG = ModelConfig.from_pretrained(LORA / "base")


def copy(tmp_path, name: str = "r4_qv", **config_changes):
    folder = tmp_path / name
    shutil.copytree(LORA / name, folder)
    if config_changes:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return folder


def test_scale_is_folded_into_b():
    plain = load_adapter(LORA / "r4_qv", CONFIG, 8)  # alpha 8 / r 4
    rs = load_adapter(LORA / "r8_rslora_attn", CONFIG, 8)  # alpha 16 / sqrt(8)
    assert plain.config.scale == 2.0 and rs.config.scale == pytest.approx(16 / np.sqrt(8))
    raw = load_file(str(LORA / "r4_qv" / "adapter_model.safetensors"))
    a, b = plain.weights[(1, "v_proj")]
    prefix = "base_model.model.model.layers.1.self_attn.v_proj"
    np.testing.assert_array_equal(a, raw[f"{prefix}.lora_A.weight"].T)
    np.testing.assert_allclose(b, 2.0 * raw[f"{prefix}.lora_B.weight"].T)
    assert set(plain.weights) == {(layer, m) for layer in range(2) for m in ("q_proj", "v_proj")}


def test_target_modules_as_a_pattern_or_all_linear(tmp_path):
    assert load_adapter(copy(tmp_path, target_modules=r".*\.(q|v)_proj"), CONFIG, 8).config.target_modules == \
        ("q_proj", "v_proj")
    full = load_adapter(copy(tmp_path / "x", "r8_all", target_modules="all-linear"), CONFIG, 8)
    assert len(full.config.target_modules) == 7


@pytest.mark.parametrize("changes, reason", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 16}, "rank 16 exceeds --max-lora-rank 8"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens are not supported"),
    ({"bias": "all"}, "biases"),
    ({"r": 2}, r"lora_A \(4, 64\) / lora_B \(64, 4\) do not fit"),
])
def test_refusals_name_the_file_and_the_reason(tmp_path, changes, reason):
    with pytest.raises(LoRAError, match=reason) as info:
        load_adapter(copy(tmp_path, **changes), CONFIG, 8)
    assert str(tmp_path) in str(info.value)


def test_missing_files_and_half_pairs(tmp_path):
    with pytest.raises(LoRAError, match="not a directory"):
        load_adapter(tmp_path / "nothing", CONFIG, 8)
    folder = copy(tmp_path)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="layer 0 q_proj has lora_A but not both"):
        load_adapter(folder, CONFIG, 8)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="adapter_model.safetensors not found"):
        load_adapter(folder, CONFIG, 8)


def test_lora_modules_forms():
    assert parse_lora_module("sql=/a/b") == ("sql", "/a/b")
    assert parse_lora_module('{"name": "sql", "path": "/a/b", "base_model_name": "x"}') == ("sql", "/a/b")
    for bad in ("sql", "=/a", '{"name": "sql"}', '{"name": "s", "path": "/p", "rank": 2}', "{oops"):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_module(bad)
