"""Readers of pre-quantized checkpoints (`jaxserve.quantization.checkpoints`) on tests/fixtures/quantized.

1. Detection from `quantization_config`, and refusal by name of every format or scheme not supported.
2. Each reader's dequantized weights equal the dequantization the fixture README specifies, computed
   here from the raw tensors (compressed-tensors) or by the fixture generator's own int4 readers
   (`tools/quant_formats.py`), plus scalar nibble checks written straight from the layout rules.
3. A float64 numpy Llama forward with the read weights reproduces the fixtures' golden logits (1e-4), and
   with `quantized_linear`'s dynamic int8 / fp8 activations the activation-quantized goldens (by RMS:
   that path is chaotic, see the fixture README).
4. Synthetic compressed-tensors layouts the fixtures lack: per-tensor, per-group and 2-D block scales.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.quantization import dequantize_weight, quantized_linear
from jaxserve.quantization.checkpoints import UnsupportedQuantization, detect_checkpoint_quantization
from jaxserve.loader.safetensors import SafetensorsFile

FIXTURES = Path(__file__).parent / "fixtures" / "quantized"
sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import quant_formats  # noqa: E402  (the fixture generator's independent numpy int4 readers)

NAMES = ["ct_int8_w8a8", "ct_fp8", "awq_int4", "gptq_int4", "gptq_int4_asym"]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


class Checkpoint:
    def __init__(self, name: str):
        self.dir = FIXTURES / name
        self.config = json.loads((self.dir / "config.json").read_text())
        self.file = SafetensorsFile(self.dir / "model.safetensors")
        self.quant = detect_checkpoint_quantization(self.config)
        self.golden = dict(np.load(self.dir / "golden.npz"))

    def get(self, name: str) -> np.ndarray:
        if name not in self.file.tensors:
            raise KeyError(name)
        return np.array(self.file.view(name))

    def prefixes(self):
        return [f"model.layers.{i}.{lin}" for i in range(self.config["num_hidden_layers"]) for lin in LINEARS]

    def read(self, prefix):
        assert self.quant.is_quantized(prefix, self.file.tensors)
        return jax.tree.map(jnp.asarray, self.quant.read_linear(prefix, self.get))


_checkpoints: dict[str, Checkpoint] = {}


def checkpoint(name: str) -> Checkpoint:
    if name not in _checkpoints:
        _checkpoints[name] = Checkpoint(name)
    return _checkpoints[name]


def test_detection_names_each_format():
    assert detect_checkpoint_quantization({"model_type": "llama"}) is None
    summaries = {n: checkpoint(n).quant.summary for n in NAMES}
    assert summaries["ct_int8_w8a8"].startswith("compressed-tensors int-quantized: int8 weights per channel, int8 "
                                                "activations per token")
    assert "fp8 weights per channel, fp8 activations" in summaries["ct_fp8"]
    assert summaries["awq_int4"] == "AutoAWQ GEMM int4 weights, groups of 32, zero points"
    assert summaries["gptq_int4"] == "GPTQ (gptq) int4 weights, groups of 32, symmetric"
    assert summaries["gptq_int4_asym"] == "GPTQ (gptq) int4 weights, groups of 64, zero points"
    assert [checkpoint(n).quant.activation_dtype for n in NAMES] == ["int8", "fp8", None, None, None]
    ct = checkpoint("ct_int8_w8a8")
    assert not ct.quant.is_quantized("lm_head", ct.file.tensors)


def test_side_file_configs_of_older_exports_are_read(tmp_path):
    """AutoGPTQ before 0.7 kept its settings in quantize_config.json only (no quant_method); AutoAWQ in
    quant_config.json with its own key names."""
    gptq = json.loads((FIXTURES / "gptq_int4" / "quantize_config.json").read_text())
    gptq.pop("quant_method")
    (tmp_path / "quantize_config.json").write_text(json.dumps(gptq))
    assert detect_checkpoint_quantization({"model_type": "llama"}, tmp_path).summary == (
        "GPTQ (gptq) int4 weights, groups of 32, symmetric")
    (tmp_path / "quantize_config.json").unlink()
    (tmp_path / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 128, "w_bit": 4,
                                                            "version": "GEMM"}))
    assert detect_checkpoint_quantization({}, tmp_path).summary == "AutoAWQ GEMM int4 weights, groups of 128, zero points"
    (tmp_path / "quant_config.json").write_text(json.dumps({"q_group_size": 128, "w_bit": 3, "version": "GEMM"}))
    with pytest.raises(UnsupportedQuantization, match="AWQ with 3 bits"):
        detect_checkpoint_quantization({}, tmp_path)
    assert detect_checkpoint_quantization({}, tmp_path / "elsewhere") is None


def _readme_dequantized(ckpt: Checkpoint, prefix: str) -> np.ndarray:
    """W.T [in, out] float32, by the fixture README's rule for the checkpoint's format."""
    g = ckpt.get
    method = ckpt.config["quantization_config"]["quant_method"]
    if method == "compressed-tensors":
        return (g(f"{prefix}.weight").astype(np.float32) * g(f"{prefix}.weight_scale")).T
    group = ckpt.config["quantization_config"]["group_size"]
    if method == "awq":
        return quant_formats.dequantize_awq(g(f"{prefix}.qweight"), g(f"{prefix}.qzeros"), g(f"{prefix}.scales"),
                                            group).T
    return quant_formats.dequantize_gptq(g(f"{prefix}.qweight"), g(f"{prefix}.qzeros"), g(f"{prefix}.scales"),
                                         g(f"{prefix}.g_idx")).T


@pytest.mark.parametrize("name", NAMES)
def test_reader_gives_the_readme_dequantization(name):
    ckpt = checkpoint(name)
    for prefix in ckpt.prefixes():
        qw = ckpt.read(prefix)
        np.testing.assert_array_equal(np.asarray(dequantize_weight(qw)), _readme_dequantized(ckpt, prefix),
                                      err_msg=prefix)
    expected = {"ct_int8_w8a8": (jnp.int8, False), "ct_fp8": (jnp.float8_e4m3fn, False), "awq_int4": (jnp.uint4, True),
                "gptq_int4": (jnp.int4, False), "gptq_int4_asym": (jnp.uint4, True)}[name]
    assert (qw.codes.dtype, qw.zeros is not None) == expected


@pytest.mark.parametrize("name", ["awq_int4", "gptq_int4_asym"])
def test_int4_elements_by_the_scalar_layout_rules(name):
    """A few elements decoded one nibble at a time, straight from the README's packing rules."""
    ckpt = checkpoint(name)
    prefix = "model.layers.1.mlp.down_proj"
    qw = ckpt.read(prefix)
    qweight, qzeros, scales = (ckpt.get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales"))
    group = ckpt.config["quantization_config"]["group_size"]
    dense = np.asarray(dequantize_weight(qw))
    for i, o in [(0, 0), (5, 13), (63, 7), (100, 31), (127, 62)]:
        if name == "awq_int4":
            k = quant_formats.AWQ_ORDER.index(o % 8)  # the nibble holding column o
            q = quant_formats.nibble(qweight[i, o // 8], k)
            z = quant_formats.nibble(qzeros[i // group, o // 8], k)
        else:
            q = quant_formats.nibble(qweight[i // 8, o], i % 8)
            z = quant_formats.nibble(qzeros[i // group, o // 8], o % 8) + 1
        want = np.float32(q - z) * np.float32(scales[i // group, o])
        assert dense[i, o] == want, (i, o)


# ---- golden logits through a numpy forward ------------------------------------------------------------

def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (np.arange(half) * 2 / x.shape[-1])
    angle = positions[:, None] * inv[None]
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def llama_logits(cfg: dict, get, linear, ids: np.ndarray) -> np.ndarray:
    """float64 Llama forward (causal, GQA, rotate-half RoPE); `linear(prefix, x)` applies a layer."""
    f64 = lambda name: get(name).astype(np.float64)  # noqa: E731
    heads, kv_heads, dim, eps = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                                 cfg["rms_norm_eps"])
    theta = cfg["rope_parameters"]["rope_theta"]
    t = len(ids)
    pos = np.arange(t)
    x = f64("model.embed_tokens.weight")[ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        h = _rms_norm(x, f64(f"{p}.input_layernorm.weight"), eps)
        q = _rope(linear(f"{p}.self_attn.q_proj", h).reshape(t, heads, dim), pos, theta)
        k = _rope(linear(f"{p}.self_attn.k_proj", h).reshape(t, kv_heads, dim), pos, theta)
        v = linear(f"{p}.self_attn.v_proj", h).reshape(t, kv_heads, dim)
        k, v = (np.repeat(a, heads // kv_heads, axis=1) for a in (k, v))
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + np.triu(np.full((t, t), -np.inf), 1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + linear(f"{p}.self_attn.o_proj", np.einsum("hts,shd->thd", probs, v).reshape(t, -1))
        h = _rms_norm(x, f64(f"{p}.post_attention_layernorm.weight"), eps)
        gate = linear(f"{p}.mlp.gate_proj", h)
        x = x + linear(f"{p}.mlp.down_proj", gate / (1 + np.exp(-gate)) * linear(f"{p}.mlp.up_proj", h))
    return _rms_norm(x, f64("model.norm.weight"), eps) @ f64("lm_head.weight").T


@pytest.mark.parametrize("name", NAMES)
def test_read_weights_reproduce_the_golden_logits(name):
    ckpt = checkpoint(name)
    dense = {p: np.asarray(dequantize_weight(ckpt.read(p)), np.float64) for p in ckpt.prefixes()}
    logits = llama_logits(ckpt.config, ckpt.get, lambda p, x: x @ dense[p], ckpt.golden["input_ids"])
    np.testing.assert_allclose(logits, ckpt.golden["logits"], atol=1e-4, rtol=0)


# RMS / max tolerances of the fixture README for activation-quantized logits.
ACT_QUANT = {"ct_int8_w8a8": ("dynamic_int8", 0.03, 0.25), "ct_fp8": ("dynamic_fp8", 0.01, 0.15)}


@pytest.mark.parametrize("name", sorted(ACT_QUANT))
def test_dynamic_activation_quantization_reproduces_the_act_quant_goldens(name):
    strategy, rms_tol, max_tol = ACT_QUANT[name]
    ckpt = checkpoint(name)
    weights = {p: ckpt.read(p) for p in ckpt.prefixes()}
    apply = jax.jit(quantized_linear, static_argnames="strategy")

    def linear(prefix, x):
        return np.asarray(apply(jnp.asarray(x, jnp.float32), weights[prefix], strategy), np.float64)

    diff = llama_logits(ckpt.config, ckpt.get, linear, ckpt.golden["input_ids"]) - ckpt.golden["logits_act_quant"]
    assert np.sqrt(np.mean(diff ** 2)) <= rms_tol and np.abs(diff).max() <= max_tol


# ---- refusals and synthetic layouts -------------------------------------------------------------------

def _ct_config(**weights):
    scheme = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False} | weights
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                    "quantization_status": "compressed",
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme}}}}


REFUSED = [
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4, "version": "gemv"}}, "AWQ version 'gemv'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "desc_act": True}}, "desc_act true"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 8}}, "GPTQ with 8 bits"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}}, "'marlin'"),
    ({"quantization_config": _ct_config()["quantization_config"] | {"format": "pack-quantized"}}, "'pack-quantized'"),
    (_ct_config(symmetric=False), "asymmetric"),
    (_ct_config(num_bits=4), "4 bits"),
    (_ct_config(strategy="token"), "strategy 'token'"),
]


@pytest.mark.parametrize("config,match", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_formats_are_refused_by_name(config, match):
    with pytest.raises(UnsupportedQuantization, match=match) as info:
        detect_checkpoint_quantization(config)
    assert "supported quantized checkpoints" in str(info.value)


def test_gptq_act_order_g_idx_is_refused_when_read():
    ckpt = checkpoint("gptq_int4")
    prefix = "model.layers.0.mlp.up_proj"
    permuted = lambda name: ckpt.get(name)[::-1].copy() if name.endswith("g_idx") else ckpt.get(name)  # noqa: E731
    with pytest.raises(UnsupportedQuantization, match="act-order"):
        ckpt.quant.read_linear(prefix, permuted)


@pytest.mark.parametrize("strategy", ["tensor", "group", "block"])
def test_compressed_tensors_scale_layouts(strategy):
    rng = np.random.default_rng(3)
    out, rows = 24, 64
    weight = rng.integers(-127, 128, size=(out, rows)).astype(np.int8)
    extra, shape = {"tensor": ({}, (1,)), "group": ({"group_size": 16}, (out, 4)),
                    "block": ({"block_structure": [16, 32]}, (2, 2))}[strategy]
    scale = rng.uniform(0.01, 0.1, size=shape).astype(ml_dtypes.bfloat16)  # hub checkpoints: bf16 scales
    quant = detect_checkpoint_quantization(_ct_config(strategy=strategy, **extra))
    tensors = {"l.weight": weight, "l.weight_scale": scale}
    got = np.asarray(dequantize_weight(jax.tree.map(jnp.asarray, quant.read_linear("l", tensors.__getitem__))))
    s = scale.astype(np.float32)
    per_element = {"tensor": lambda o, i: s[0], "group": lambda o, i: s[o, i // 16],
                   "block": lambda o, i: s[o // 16, i // 32]}[strategy]
    want = np.array([[weight[o, i] * per_element(o, i) for o in range(out)] for i in range(rows)], np.float32)
    np.testing.assert_array_equal(got, want)
