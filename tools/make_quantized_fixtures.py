#!/usr/bin/env python3
"""Generate pre-quantized checkpoints of one tiny random Llama and their golden logits (issue 27).

Run under the golden venv (recipe in golden_common.py; needs compressed-tensors):

    .venv-golden/bin/python tools/make_quantized_fixtures.py [NAME ...]

Steps, per format, into ``tests/fixtures/quantized/<name>/``:

1. Build the float32 Llama (hidden 64, 2 layers, GQA 4:2, untied; same seed for every format).
2. Write the checkpoint the way its real tool does. compressed-tensors: the library llm-compressor uses
   applies the preset scheme (W8A8, FP8_DYNAMIC), min/max observer scales are computed with its own
   `calculate_qparams`, `ModelCompressor` compresses and writes quantization_config. AWQ / GPTQ: the
   layouts of quant_formats.py (AutoAWQ GEMM; GPTQ v1), written with safetensors; config.json carries the
   quantization_config those tools write. Linear layers of the decoder are quantized; embeddings, norms
   and lm_head stay float32.
3. Read the files back with an independent reader (numpy; nibble spot checks against the spec) and check
   they decode to exactly the dequantized weights intended; for compressed-tensors, transformers'
   own loader (dequantize=True) must produce the same weights and logits.
4. Golden = the float32 Llama with the dequantized weights: ``golden.npz`` with input_ids int32 [64]
   (48 prompt + 16 greedy tokens), prompt_len, logits float32 [64, 256]; for compressed-tensors also
   logits_act_quant float32 [64, 256]: the same model with dynamic per-token activation quantization
   simulated at every quantized linear's input (int8: scale absmax/127, round half to even; fp8 e4m3:
   scale absmax/448), the rule vLLM's kernels use. compressed-tensors' own fake quantization (int8 scale
   absmax/127.5) is reproduced exactly by the same hook, and the gap between the two rules is printed.
"""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import quant_formats as qf
from golden_common import (FIXTURES_ROOT, NEW_TOKENS, PROMPT_LEN, TINY_LLAMA, choose_prompt, forward_logits,
                           fresh_dir, list_dir, random_model, save_npz_deterministic, setup_determinism)

OUT_ROOT = FIXTURES_ROOT / "quantized"
INIT_SEED = 2001
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

FORMATS = {
    "ct_int8_w8a8": dict(kind="ct", preset="W8A8", ct_format="int-quantized", act="int8", prompt_seed0=3000),
    "ct_fp8": dict(kind="ct", preset="FP8_DYNAMIC", ct_format="float-quantized", act="fp8", prompt_seed0=3100),
    "awq_int4": dict(kind="awq", group_size=32, prompt_seed0=3200),
    "gptq_int4": dict(kind="gptq", group_size=32, sym=True, prompt_seed0=3300),
    "gptq_int4_asym": dict(kind="gptq", group_size=64, sym=False, prompt_seed0=3400),
}


def quantized_names(model) -> list[str]:
    return [f"model.layers.{i}.{lin}" for i in range(model.config.num_hidden_layers) for lin in LINEARS]


# --------------------------------------------------------------------------- writers
def write_compressed_tensors(base, spec: dict, out_dir) -> dict[str, np.ndarray]:
    """llm-compressor's path: apply the preset, observe min/max per output channel, compress, save.

    Returns the dequantized weights intended, computed here independently of the compressor:
    int8 q = clamp(round(w / s), -128, 127); fp8 q = float8_e4m3fn(clamp(w / s, -448, 448)); W = q * s.
    """
    model = copy.deepcopy(base)
    intended = {}
    scheme = preset_name_to_scheme(spec["preset"], ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for name in quantized_names(model):
        mod = model.get_submodule(name)
        w = mod.weight.data
        scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True),
                                        mod.quantization_scheme.weights)
        mod.weight_scale.data.copy_(scale)
        mod.weight_zero_point.data.copy_(zero)
        assert scale.shape == (w.shape[0], 1) and not zero.any()
        if spec["act"] == "int8":
            q = torch.clamp(torch.round(w / scale), -128, 127)
        else:
            q = torch.clamp(w / scale, -448.0, 448.0).to(torch.float8_e4m3fn).float()
        intended[name] = (q * scale).numpy()
    compressor = ModelCompressor.from_pretrained_model(model, spec["ct_format"])
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(str(out_dir))
    return intended


def int4_config(spec: dict) -> dict:
    if spec["kind"] == "awq":  # what AutoAWQ's save_quantized puts in config.json
        return {"quant_method": "awq", "bits": 4, "group_size": spec["group_size"], "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": spec["group_size"], "desc_act": False,
            "sym": spec["sym"], "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False}


def write_int4(base, spec: dict, out_dir) -> dict[str, np.ndarray]:
    """AWQ / GPTQ checkpoint; returns the dequantized weight each quantized linear encodes."""
    tensors = {k: v.numpy().copy() for k, v in base.state_dict().items()}
    intended = {}
    for name in quantized_names(base):
        w = tensors.pop(f"{name}.weight")
        if spec["kind"] == "awq":
            parts, intended[name] = qf.awq_tensors(w, spec["group_size"])
        else:
            parts, intended[name] = qf.gptq_tensors(w, spec["group_size"], spec["sym"])
        tensors.update({f"{name}.{k}": v for k, v in parts.items()})
    # safetensors.numpy writes a strided array's buffer as is: make every tensor C-contiguous first.
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    base.config.save_pretrained(out_dir)
    base.generation_config.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = int4_config(spec)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if spec["kind"] == "gptq":  # GPTQModel / AutoGPTQ also write the config on its own
        (out_dir / "quantize_config.json").write_text(json.dumps(cfg["quantization_config"], indent=2) + "\n")
    return intended


# --------------------------------------------------------------------------- readers
def read_dequantized(out_dir, spec: dict, names: list[str]) -> dict[str, np.ndarray]:
    """Independent reader: the float32 weight [out, in] each quantized linear stores."""
    weights = {}
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    for name in names:
        if spec["kind"] == "ct":
            w, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
            assert w.dtype == (torch.int8 if spec["act"] == "int8" else torch.float8_e4m3fn), w.dtype
            assert s.dtype == torch.float32 and s.shape == (w.shape[0], 1), (s.dtype, s.shape)
            weights[name] = (w.float() * s).numpy()
            continue
        qw, qz, sc = (t[f"{name}.{k}"].numpy() for k in ("qweight", "qzeros", "scales"))
        assert qw.dtype == qz.dtype == np.int32 and sc.dtype == np.float16
        if spec["kind"] == "awq":
            weights[name] = qf.dequantize_awq(qw, qz, sc, spec["group_size"])
            spot_check_awq(qw)
        else:
            g_idx = t[f"{name}.g_idx"].numpy()
            assert np.array_equal(g_idx, np.arange(qw.shape[0] * 8) // spec["group_size"])
            if spec["sym"]:
                assert np.all(qz.view(np.uint32) == 0x77777777), "symmetric GPTQ v1 stores zero-1 = 7"
            weights[name] = qf.dequantize_gptq(qw, qz, sc, g_idx)
            spot_check_gptq(qw)
    return weights


def spot_check_awq(qweight: np.ndarray) -> None:
    codes = qf.unpack_awq(qweight)
    for i, o in np.random.default_rng(0).integers(0, [codes.shape[0], codes.shape[1]], size=(32, 2)):
        assert codes[i, o] == qf.nibble(qweight[i, o // 8], qf.AWQ_ORDER.index(o % 8))


def spot_check_gptq(qweight: np.ndarray) -> None:
    codes = qf.unpack_gptq_qweight(qweight)
    for i, o in np.random.default_rng(0).integers(0, [codes.shape[0], codes.shape[1]], size=(32, 2)):
        assert codes[i, o] == qf.nibble(qweight[i // 8, o], i % 8)


def dequantized_model(base, weights: dict[str, np.ndarray]):
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(torch.from_numpy(w))
    return model.eval()


# --------------------------------------------------------------------------- activation quantization
def act_quant_hook(kind: str, rule: str = "vllm"):
    """Forward pre-hook: dynamic per-token (per row) symmetric quantize-dequantize of a linear's input."""
    def hook(_mod, args):
        x = args[0]
        absmax = x.abs().amax(dim=-1, keepdim=True)
        if kind == "fp8":
            scale = absmax / 448.0
            xq = torch.clamp(x / scale, -448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)
            return (xq * scale,)
        if rule == "vllm":  # scale absmax/127, x * (127/absmax) rounded half to even
            return (torch.clamp(torch.round(x * (127.0 / absmax)), -128, 127) * (absmax / 127.0),)
        scale = absmax / 127.5  # compressed-tensors' calculate_qparams: absmax / ((127 - -128) / 2)
        return (torch.clamp(torch.round(x / scale), -128, 127) * scale,)
    return hook


def act_quant_logits(model, names, ids, kind: str, rule: str = "vllm") -> np.ndarray:
    handles = [model.get_submodule(n).register_forward_pre_hook(act_quant_hook(kind, rule)) for n in names]
    try:
        return forward_logits(model, ids)
    finally:
        for h in handles:
            h.remove()


def check_with_transformers(out_dir, deq_model, names, ids, logits, kind: str) -> None:
    """transformers + compressed-tensors read the same checkpoint: same weights, same logits."""
    hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=CompressedTensorsConfig(dequantize=True))
    for n in names:
        assert torch.equal(hf.get_submodule(n).weight, deq_model.get_submodule(n).weight), n
    assert np.array_equal(forward_logits(hf.eval(), ids), logits)
    fq = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    ct_fq = forward_logits(fq.eval(), ids)  # compressed-tensors' own fake quantization of activations
    mine = act_quant_logits(deq_model, names, ids, kind, rule="compressed-tensors")
    assert np.allclose(ct_fq, mine, atol=1e-5, rtol=0), np.abs(ct_fq - mine).max()
    print(f"  transformers (dequantize=True) weights and logits identical; compressed-tensors' fake-quant "
          f"forward == hook with its rule (max|diff| {np.abs(ct_fq - mine).max():.1e})")


def report_sensitivity(model, names, ids, golden: dict, kind: str) -> None:
    """How far float32-level noise upstream moves each golden: the basis of the README's tolerances."""
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    for seed in range(3):
        noisy = copy.deepcopy(model)
        with torch.no_grad():
            e = noisy.model.embed_tokens.weight
            e.mul_(1 + 1e-6 * torch.randn(e.shape, generator=torch.Generator().manual_seed(seed)))
        plain = forward_logits(noisy, ids) - golden["logits"]
        aq = act_quant_logits(noisy, names, ids, kind)
        agree = np.mean(aq.argmax(-1) == golden["logits_act_quant"].argmax(-1))
        aq = aq - golden["logits_act_quant"]
        print(f"  1e-6 embedding noise (seed {seed}): logits max {np.abs(plain).max():.1e}; logits_act_quant max "
              f"{np.abs(aq).max():.3f} rms {rms(aq):.4f}, argmax agrees {agree:.1%}")
    effect = golden["logits_act_quant"] - golden["logits"]
    print(f"  activation quantization itself: max {np.abs(effect).max():.3f} rms {rms(effect):.4f}; argmax agrees "
          f"with logits on {np.mean(golden['logits_act_quant'].argmax(-1) == golden['logits'].argmax(-1)):.0%}")


# --------------------------------------------------------------------------- main
def make_fixture(name: str, base, float_logits_of) -> None:
    spec = FORMATS[name]
    out_dir = fresh_dir(OUT_ROOT / name)
    names = quantized_names(base)
    intended = write_compressed_tensors(base, spec, out_dir) if spec["kind"] == "ct" else write_int4(
        base, spec, out_dir)
    weights = read_dequantized(out_dir, spec, names)
    for n in names:
        assert np.array_equal(weights[n], intended[n]), f"{n}: files do not decode to the intended weights"
    model = dequantized_model(base, weights)
    err = max(float(np.abs(weights[n] - base.get_submodule(n).weight.detach().numpy()).max()) for n in names)

    seed, prompt, greedy, logits, gap, distinct = choose_prompt(
        model, TINY_LLAMA["vocab_size"], spec["prompt_seed0"], NEW_TOKENS, 12)
    ids = np.concatenate([prompt, greedy]).astype(np.int32)
    arrays = {"input_ids": ids, "prompt_len": np.array(PROMPT_LEN, dtype=np.int32), "logits": logits}
    if spec["kind"] == "ct":
        check_with_transformers(out_dir, model, names, ids, logits, spec["act"])
        arrays["logits_act_quant"] = act_quant_logits(model, names, ids, spec["act"])
        if spec["act"] == "int8":
            ct_rule = act_quant_logits(model, names, ids, "int8", rule="compressed-tensors")
            print(f"  int8 activation rules absmax/127 vs /127.5: max|logit diff| "
                  f"{np.abs(ct_rule - arrays['logits_act_quant']).max():.4f}")
        report_sensitivity(model, names, ids, arrays, spec["act"])
    save_npz_deterministic(out_dir / "golden.npz", arrays)

    print(f"{name}: prompt_seed={seed} min_gap={gap:.4f} distinct={distinct}; max|W - W_dequant| {err:.4f}; "
          f"dequantized vs float model logits: max|diff| {np.abs(logits - float_logits_of(ids)).max():.4f}")
    with safe_open(out_dir / "model.safetensors", "pt") as f:
        for k in sorted(f.keys()):
            if k.startswith("model.layers.0.self_attn.q_proj") or k.startswith("model.layers.0.mlp.down_proj"):
                print(f"  {k:45s} {str(f.get_slice(k).get_dtype()):8s} {f.get_slice(k).get_shape()}")
    print("  quantization_config:", json.dumps(json.loads((out_dir / "config.json").read_text())["quantization_config"],
                                               sort_keys=True))
    list_dir(out_dir)


def main(argv: list[str]) -> int:
    setup_determinism()
    base = random_model("llama", TINY_LLAMA, INIT_SEED)
    for name in argv[1:] or list(FORMATS):
        make_fixture(name, base, lambda ids: forward_logits(base, ids))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
