"""Checks that each family feature of a parity fixture is really active in transformers (golden venv only).

A fixture only tests a feature if switching the feature off changes the logits. Each check here rebuilds
the model with one setting changed (same weights), compares, and prints what a loader must reproduce:

1. `check_sliding_window`: positions before the window equal the no-window model, later ones differ.
2. `check_changes_logits`: generic "this config value matters" (soft caps, query scale, RoPE scaling).
3. `check_final_softcap`: the golden logits are `cap * tanh(raw / cap)` of the uncapped model's logits.
4. `check_llama3_rope` / `check_gemma3_rope`: the inverse frequencies transformers uses, per layer type.
5. `RouterProbe`: records MoE router logits during a forward; `routing_problem` rejects prompts whose
   top-k choice is nearly tied (a float-level difference would flip an expert) or that use few experts.
6. `check_legacy_config`: the same weights under the transformers-4 spelling of the config give the same
   logits, so a loader can be tested against both spellings.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from golden_common import forward_logits

ROUTER_MIN_MARGIN = 1e-2  # k-th vs (k+1)-th router logit, every token of every MoE layer


def rebuilt(model, **changes):
    """The same weights under a config with `changes` applied."""
    cfg = copy.deepcopy(model.config)
    for key, value in changes.items():
        setattr(cfg, key, value)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    return ref.eval()


def check_sliding_window(model, ids: np.ndarray, logits: np.ndarray, window: int, off_value=None) -> None:
    """Query i attends key j iff 0 <= i - j < window: logits at positions < window equal the no-window model."""
    diff = np.abs(forward_logits(rebuilt(model, sliding_window=off_value), ids) - logits).max(axis=-1)
    assert np.all(diff[:window] == 0.0), f"positions < window differ: {diff[:window]}"
    assert np.all(diff[window:] > 1e-4), f"sliding window not active: {diff[window:]}"
    print(f"  sliding window check: max|diff| pos<{window}: {diff[:window].max():.2e}; "
          f"pos>={window}: min {diff[window:].min():.3f} (window active; position {window} "
          f"no longer sees token 0)")


def check_changes_logits(model, ids: np.ndarray, logits: np.ndarray, what: str, **changes) -> None:
    diff = float(np.abs(forward_logits(rebuilt(model, **changes), ids) - logits).max())
    assert diff > 1e-2, f"{what} has no effect (max|diff| {diff:.2e})"
    print(f"  {what} active: max|logit diff| {diff:.3f} when {changes}")


def check_final_softcap(model, ids: np.ndarray, logits: np.ndarray, cap: float) -> None:
    raw = forward_logits(rebuilt(model, final_logit_softcapping=None), ids)
    expect = (cap * np.tanh(raw.astype(np.float64) / cap)).astype(np.float32)
    assert np.allclose(expect, logits, atol=1e-5, rtol=0), np.abs(expect - logits).max()
    print(f"  final softcap {cap}: logits == cap*tanh(raw/cap) (max|diff| {np.abs(expect - logits).max():.1e});"
          f" raw max |logit| {np.abs(raw).max():.2f}, {np.mean(np.abs(raw) > cap / 2):.1%} of raw logits"
          f" beyond cap/2")


def check_llama3_rope(model, rope: dict, head_dim: int) -> None:
    inv = model.model.rotary_emb.inv_freq.double().numpy()
    base = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / base
    orig = rope["original_max_position_embeddings"]
    low = orig / rope["low_freq_factor"]
    high = orig / rope["high_freq_factor"]
    kept = wavelen < high
    scaled = wavelen > low
    smooth = ~kept & ~scaled
    assert kept.any() and scaled.any() and smooth.any(), (kept, scaled, smooth)
    assert np.allclose(inv[kept], base[kept], rtol=1e-6)
    assert np.allclose(inv[scaled], base[scaled] / rope["factor"], rtol=1e-6)
    assert not np.allclose(inv[smooth], base[smooth], rtol=1e-3)
    print(f"  llama3 rope: {kept.sum()} freqs unchanged, {smooth.sum()} smoothed, "
          f"{scaled.sum()} divided by factor")


def check_gemma3_rope(model, rope: dict, head_dim: int) -> None:
    """Local layers use theta_local unscaled; global layers use theta_global with linear scaling."""
    exps = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    emb = model.model.rotary_emb
    for layer_type, params in rope.items():
        want = 1.0 / (params["rope_theta"] ** exps)
        if params["rope_type"] == "linear":
            want = want / params["factor"]
        else:
            assert params["rope_type"] == "default", params
        got = getattr(emb, f"{layer_type}_inv_freq").double().numpy()
        assert np.allclose(got, want, rtol=1e-6), (layer_type, got, want)
    print(f"  gemma3 rope per layer type verified: {rope}")


class RouterProbe:
    """Forward hooks on every MoE router; `logits` maps layer index -> router logits [tokens, experts]."""

    def __init__(self, model):
        self.logits: dict[int, np.ndarray] = {}
        self.top_k = model.config.num_experts_per_tok
        self._handles = []
        for name, mod in model.named_modules():
            if type(mod).__name__.endswith("TopKRouter"):
                layer = int(name.split(".layers.")[1].split(".")[0])
                self._handles.append(mod.register_forward_hook(self._hook(layer)))
        assert self._handles, "no MoE router found"

    def _hook(self, layer: int):
        def hook(_mod, _inp, out):
            self.logits[layer] = out[0].detach().float().numpy()
        return hook

    def stats(self) -> dict[int, tuple[int, float]]:
        """Per MoE layer: (experts chosen by at least one token, min k-th vs (k+1)-th router logit margin)."""
        out = {}
        for layer, lg in sorted(self.logits.items()):
            order = np.sort(lg, axis=-1)[:, ::-1]
            margin = float((order[:, self.top_k - 1] - order[:, self.top_k]).min())
            chosen = np.argsort(-lg, axis=-1, kind="stable")[:, : self.top_k]
            out[layer] = (len(np.unique(chosen)), margin)
        return out


def routing_problem(model, ids: np.ndarray) -> str | None:
    """None when every MoE layer routes to more than half the experts with clear top-k margins."""
    probe = RouterProbe(model)
    forward_logits(model, ids)
    n_experts = model.config.num_local_experts
    for layer, (used, margin) in probe.stats().items():
        if used <= n_experts // 2 or margin <= ROUTER_MIN_MARGIN:
            return f"layer {layer}: {used}/{n_experts} experts used, router margin {margin:.2e}"
    return None


def report_routing(model, ids: np.ndarray) -> None:
    probe = RouterProbe(model)
    forward_logits(model, ids)
    lg = next(iter(probe.logits.values()))
    for layer, (used, margin) in probe.stats().items():
        print(f"  MoE layer {layer}: {used}/{model.config.num_local_experts} experts used over "
              f"{lg.shape[0]} tokens, min top-{probe.top_k} router margin {margin:.4f}")


def check_legacy_config(out_dir: Path, legacy: dict, ids: np.ndarray, logits: np.ndarray) -> None:
    """Load the saved weights under `legacy` (the transformers-4 spelling): the logits must be identical."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(out_dir / "model.safetensors", tmp)
        (Path(tmp) / "config.json").write_text(json.dumps(legacy))
        ref = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        got = forward_logits(ref.eval(), ids)
    assert np.array_equal(got, logits), np.abs(got - logits).max()
    print(f"  config_legacy.json reproduces the logits exactly (keys: {sorted(legacy)})")
