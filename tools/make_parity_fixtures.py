#!/usr/bin/env python3
"""Generate golden parity fixtures from Hugging Face transformers (PyTorch, float32).

Run with the dedicated golden venv (torch never goes into the project venv; recipe in golden_common.py):

    .venv-golden/bin/python tools/make_parity_fixtures.py [NAME ...]

For every config below it builds a tiny random model, re-initialises all weights with a fixed seed
(large enough std that logits are far from flat, RMSNorm weights are not all ones and MoE routers
route), saves it with ``save_pretrained`` into ``tests/fixtures/parity/<name>/`` and writes
``golden.npz`` with

    input_ids   int32 [64]         48 prompt tokens + 16 greedy tokens
    prompt_len  int32 scalar       48
    logits      float32 [64, V]    logits of one full forward over all 64 tokens
    greedy      int32 [64]         (families added for issue 29 only) 64 tokens of model.generate
                                   (do_sample=False, KV cache) after the prompt; greedy[:16] == input_ids[48:]

and, for those families, ``config_legacy.json``: the same model in the config spelling of hub checkpoints
written by transformers 4 (rope_theta / rope_scaling / rope_local_base_freq, sliding_window_pattern,
num_experts), verified to give identical logits. Each family feature is checked to be active
(parity_checks.py). The script is deterministic (fixed seeds, one CPU thread, fixed zip timestamps).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import parity_checks as checks
from golden_common import (FIXTURES_ROOT, NEW_TOKENS, PROMPT_LEN, REPO_ROOT, choose_prompt, forward_logits,
                           fresh_dir, list_dir, random_model, save_model, save_npz_deterministic, setup_determinism)

OUT_ROOT = FIXTURES_ROOT / "parity"
GREEDY_LONG = 64  # issue 29: greedy generation compared token for token for 64 tokens

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, dtype="float32")

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
               FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}


@dataclass(frozen=True)
class Fixture:
    model_type: str
    overrides: dict
    init_seed: int
    prompt_seed0: int
    greedy_tokens: int = 0  # 0: the original six (16 greedy tokens, no `greedy` key)
    unit_offset_norm: bool = False  # Gemma RMSNorm scales by (1 + weight)
    # Gemma multiplies embeddings by sqrt(hidden); with the default N(0, 0.5) the tied embedding dominates
    # the residual stream and greedy decoding just copies its input token. Small embeddings (as real Gemma
    # checkpoints have) plus a larger final-norm gain keep the logits' spread without the copying.
    embed_std: float = 0.5
    final_norm_gain: float = 1.0
    min_distinct: int = 12
    extra: dict = field(default_factory=dict)


def _default_rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


FIXTURES: dict[str, Fixture] = {
    "llama_gqa_untied": Fixture("llama", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_parameters=_default_rope(10000.0),
        tie_word_embeddings=False), 1001, 0),
    "llama3_tied_headdim": Fixture("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=True), 1002, 100),
    "llama_bias": Fixture("llama", dict(
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters=_default_rope(10000.0), tie_word_embeddings=False), 1003, 200),
    "mistral_sliding": Fixture("mistral", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=16,
        rope_parameters=_default_rope(1000000.0), tie_word_embeddings=False), 1004, 300),
    "qwen2_bias": Fixture("qwen2", dict(
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters=_default_rope(1000000.0), tie_word_embeddings=True), 1005, 400),
    "qwen3_qknorm": Fixture("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False, rms_norm_eps=1e-6,
        use_sliding_window=False, rope_parameters=_default_rope(1000000.0), tie_word_embeddings=False),
        1006, 500),
    # ---- issue 29 families (64 greedy tokens, config_legacy.json, feature checks) ----
    "gemma2_softcap": Fixture("gemma2", dict(
        num_hidden_layers=4, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=24, sliding_window=8, layer_types=[SLIDING, FULL] * 2,
        attn_logit_softcapping=10.0, final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, rope_parameters=_default_rope(10000.0), tie_word_embeddings=True),
        1007, 600, GREEDY_LONG, unit_offset_norm=True, min_distinct=16,
        embed_std=0.05, final_norm_gain=3.0),
    "gemma3_text": Fixture("gemma3_text", dict(
        num_hidden_layers=6, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        query_pre_attn_scalar=24, sliding_window=12, layer_types=[SLIDING] * 5 + [FULL],
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_parameters=GEMMA3_ROPE,
        tie_word_embeddings=True), 1008, 700, GREEDY_LONG, unit_offset_norm=True, min_distinct=16,
        embed_std=0.05, final_norm_gain=3.0),
    "gemma3_text_hd256": Fixture("gemma3_text", dict(
        hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, layer_types=[SLIDING, FULL],
        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_parameters=GEMMA3_ROPE,
        tie_word_embeddings=True), 1009, 800, GREEDY_LONG, unit_offset_norm=True, min_distinct=16,
        embed_std=0.05, final_norm_gain=3.0),
    "qwen3_moe": Fixture("qwen3_moe", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], attention_bias=False, rms_norm_eps=1e-6,
        use_sliding_window=False, rope_parameters=_default_rope(1000000.0), tie_word_embeddings=False),
        1010, 900, GREEDY_LONG, min_distinct=16),
    "mixtral": Fixture("mixtral", dict(
        num_hidden_layers=2, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=20,
        rope_parameters=_default_rope(1000000.0), tie_word_embeddings=False),
        1011, 1000, GREEDY_LONG, min_distinct=16),
}
MOE_TYPES = ("qwen3_moe", "mixtral")


def check_config_file(name: str, out_dir, fx: Fixture) -> dict:
    raw = json.loads((out_dir / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(out_dir)
    assert raw["model_type"] == fx.model_type
    for k, v in {**COMMON, **fx.overrides}.items():
        got = getattr(loaded, k)
        if k == "dtype":
            assert str(got).endswith("float32"), got
        elif k == "rope_parameters":
            nested = v if SLIDING in v else {None: v}
            for layer_type, params in nested.items():
                g = got[layer_type] if layer_type else got
                assert all(g[rk] == rv for rk, rv in params.items()), (name, got, v)
        else:
            assert got == v, (name, k, got, v)
    return raw


def legacy_config(raw: dict) -> dict:
    """The transformers-4 spelling of a saved config (as most hub checkpoints still have it)."""
    dropped = ("rope_parameters", "dtype", "transformers_version", "_sliding_window_pattern")
    cfg = {k: v for k, v in raw.items() if k not in dropped}
    cfg["torch_dtype"] = raw["dtype"]
    rope = raw["rope_parameters"]
    if SLIDING in rope:  # Gemma 3: one RoPE per layer type
        cfg["rope_local_base_freq"] = rope[SLIDING]["rope_theta"]
        rope = rope[FULL]
    cfg["rope_theta"] = rope["rope_theta"]
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
    if raw["model_type"] in ("gemma2", "gemma3_text"):
        # Older configs have no layer_types: layer i is sliding iff (i + 1) % pattern != 0.
        pattern = raw["layer_types"].index(FULL) + 1
        derived = [SLIDING if (i + 1) % pattern else FULL for i in range(raw["num_hidden_layers"])]
        assert derived == raw["layer_types"], (derived, raw["layer_types"])
        del cfg["layer_types"]
        if raw["model_type"] == "gemma3_text":
            cfg["sliding_window_pattern"] = pattern
        else:
            assert pattern == 2, "gemma2 always alternates"
    if raw["model_type"] == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    return cfg


def family_checks(model, fx: Fixture, ids: np.ndarray, logits: np.ndarray, long_ids: np.ndarray) -> None:
    o = fx.overrides
    if fx.model_type == "mistral":
        checks.check_sliding_window(model, ids, logits, o["sliding_window"])
    if fx.model_type == "mixtral":
        checks.check_sliding_window(model, ids, logits, o["sliding_window"])
    if fx.model_type in ("gemma2", "gemma3_text"):
        scale = model.model.embed_tokens.embed_scale
        assert scale.dtype == torch.float32 and float(scale) == np.float32(np.sqrt(model.config.hidden_size))
        print(f"  embedding scale sqrt(hidden) = {float(scale)!r} (float32)")
        checks.check_sliding_window(model, ids, logits, o["sliding_window"], off_value=4096)
        if o["query_pre_attn_scalar"] != o["head_dim"]:
            checks.check_changes_logits(model, ids, logits, "query_pre_attn_scalar",
                                        query_pre_attn_scalar=o["head_dim"])
    if fx.model_type == "gemma2":
        checks.check_changes_logits(model, ids, logits, "attn_logit_softcapping", attn_logit_softcapping=None)
        checks.check_final_softcap(model, ids, logits, o["final_logit_softcapping"])
    if fx.model_type == "gemma3_text":
        checks.check_gemma3_rope(model, o["rope_parameters"], o["head_dim"])
        unscaled = {SLIDING: o["rope_parameters"][SLIDING], FULL: {**o["rope_parameters"][FULL], "factor": 1.0}}
        checks.check_changes_logits(model, ids, logits, "global linear RoPE scaling", rope_parameters=unscaled)
    if fx.model_type in MOE_TYPES:
        checks.report_routing(model, long_ids)
    if fx.model_type == "qwen3_moe":
        checks.check_changes_logits(model, ids, logits, "norm_topk_prob", norm_topk_prob=False)
    rope = o.get("rope_parameters", {})
    if rope.get("rope_type") == "llama3":
        checks.check_llama3_rope(model, rope, o["head_dim"])


def make_fixture(name: str) -> None:
    fx = FIXTURES[name]
    out_dir = fresh_dir(OUT_ROOT / name)
    model = random_model(fx.model_type, {**COMMON, **fx.overrides}, fx.init_seed,
                         unit_offset_norm=fx.unit_offset_norm, embed_std=fx.embed_std)
    cfg = model.config
    if fx.final_norm_gain != 1.0:
        with torch.no_grad():
            w = model.model.norm.weight
            w.copy_((1 + w) * fx.final_norm_gain - 1 if fx.unit_offset_norm else w * fx.final_norm_gain)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert all(p.dtype == torch.float32 for p in model.parameters())

    n_new = fx.greedy_tokens or NEW_TOKENS
    extra = (lambda ids: checks.routing_problem(model, ids)) if fx.model_type in MOE_TYPES else None
    seed, prompt, greedy, long_logits, gap, distinct = choose_prompt(
        model, cfg.vocab_size, fx.prompt_seed0, n_new, fx.min_distinct, extra)
    ids = np.concatenate([prompt, greedy[:NEW_TOKENS]]).astype(np.int32)
    logits = long_logits if n_new == NEW_TOKENS else forward_logits(model, ids)
    # The 64-token golden forward is causal: it must agree with the longer forward's first 64 rows.
    assert np.allclose(logits, long_logits[: len(ids)], atol=1e-5, rtol=0)

    save_model(model, out_dir)
    raw_cfg = check_config_file(name, out_dir, fx)
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    assert np.array_equal(forward_logits(reloaded.eval(), ids), logits), "reloaded checkpoint differs"

    arrays = {"input_ids": ids, "prompt_len": np.array(PROMPT_LEN, dtype=np.int32),
              "logits": logits.astype(np.float32)}
    if fx.greedy_tokens:
        arrays["greedy"] = greedy.astype(np.int32)
        legacy = legacy_config(raw_cfg)
        (out_dir / "config_legacy.json").write_text(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
        checks.check_legacy_config(out_dir, legacy, ids, logits)
    save_npz_deterministic(out_dir / "golden.npz", arrays)

    family_checks(model, fx, ids, logits, np.concatenate([prompt, greedy]))
    with safe_open(out_dir / "model.safetensors", "np") as f:
        keys = sorted(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in keys}
    assert dtypes == {"float32"}, dtypes
    assert ("lm_head.weight" in keys) == (not cfg.tie_word_embeddings), keys

    print(f"{name}: model_type={fx.model_type} prompt_seed={seed} tensors={len(keys)} "
          f"min_gap={gap:.4f} distinct={distinct} (over {n_new} greedy tokens)")
    list_dir(out_dir)
    print(f"  greedy: {greedy.tolist()}")
    print(f"  logits std={logits.std():.3f}; config keys: {sorted(raw_cfg)}")
    print(f"  layer-0 tensors: {[k for k in keys if '.0.' in k and 'experts.' not in k]}")


def main(argv: list[str]) -> int:
    setup_determinism()
    names = argv[1:] or list(FIXTURES)
    for name in names:
        make_fixture(name)
    total = sum(p.stat().st_size for p in OUT_ROOT.rglob("*") if p.is_file())
    print(f"total size under {OUT_ROOT.relative_to(REPO_ROOT)}: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
