#!/usr/bin/env python3
"""Generate a tiny random Llama base and random PEFT LoRA adapters with golden logits (issue 31).

Run under the golden venv (recipe in golden_common.py; needs peft):

    .venv-golden/bin/python tools/make_lora_fixtures.py

Steps, into ``tests/fixtures/lora/``:

1. ``base/``: a float32 Llama (hidden 64, 2 layers, GQA 4:2, untied) saved with ``save_pretrained``.
2. One PEFT adapter per entry of ADAPTERS, made with ``get_peft_model`` and saved with ``save_pretrained``
   (adapter_config.json + adapter_model.safetensors; PEFT's generated README.md model card is removed and
   target_modules is sorted, since PEFT writes it in set order).
   A and B are re-drawn with a fixed seed (PEFT initialises B to zero, which would make the adapter a
   no-op), with a std chosen so that scale * B @ A has elements of std ~0.045 (base weights: 0.15).
3. One prompt (48 tokens) shared by the base and every golden adapter, accepted when each model's 16
   greedy tokens have clear top-1/top-2 gaps, enough distinct tokens and no EOS.
4. ``golden.npz`` in ``base/`` and in each golden adapter's folder: input_ids int32 [64] (the prompt plus
   that model's 16 greedy tokens), prompt_len 48, logits float32 [64, 256] from transformers + peft.
5. Checks: the saved adapter reloads (PeftModel.from_pretrained) to identical logits, and merging
   W + scale * B @ A by hand from the files (scale = lora_alpha / r, or lora_alpha / sqrt(r) with
   use_rslora) reproduces them; each adapter moves the logits and changes some greedy tokens.
   ``dora`` and ``modules_to_save`` adapters have no golden: they exist for refusal tests.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import load_file

from golden_common import (EOS_ID, FIXTURES_ROOT, MIN_GAP, NEW_TOKENS, PROMPT_LEN, TINY_LLAMA, forward_logits,
                           fresh_dir, generate_greedy, greedy_margin_report, list_dir, random_model, save_model,
                           save_npz_deterministic, setup_determinism)

OUT_ROOT = FIXTURES_ROOT / "lora"
INIT_SEED = 4001
PROMPT_SEED0 = 4100
DELTA_STD = 0.045  # target std of the elements of scale * B @ A
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]

# name -> (LoraConfig arguments, seed, has golden)
ADAPTERS: dict[str, tuple[dict, int, bool]] = {
    "r4_qv": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), 4201, True),
    "r8_all": (dict(r=8, lora_alpha=16, target_modules=ATTN + MLP), 4202, True),
    "r8_rslora_attn": (dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ATTN), 4203, True),
    "r4_mlp_alpha4": (dict(r=4, lora_alpha=4, target_modules=MLP), 4204, True),
    "dora": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True), 4205, False),
    "modules_to_save": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             modules_to_save=["lm_head"]), 4206, False),
}


def lora_scale(cfg: dict) -> float:
    return cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])


def make_adapter(base, name: str):
    args, seed, _ = ADAPTERS[name]
    model = get_peft_model(copy.deepcopy(base), LoraConfig(lora_dropout=0.0, bias="none", **args))
    std = math.sqrt(DELTA_STD / (lora_scale(args) * math.sqrt(args["r"])))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            if ".lora_A." in pname or ".lora_B." in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif "modules_to_save" in pname:  # a trained copy differs from the base module
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def merged_by_hand(base, adapter_dir) -> torch.nn.Module:
    """Apply W += scale * B @ A from the saved files, reading only adapter_config.json and the tensors."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = lora_scale(cfg)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    merged = copy.deepcopy(base)
    prefix = "base_model.model."
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(prefix):-len(".lora_A.weight")]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            assert a.shape == (cfg["r"], a.shape[1]) and b.shape == (b.shape[0], cfg["r"]), (key, a.shape, b.shape)
            assert module.rsplit(".", 1)[1] in cfg["target_modules"], module
            merged.get_submodule(module).weight.add_(torch.from_numpy(scale * (b @ a)))
    return merged.eval()


def choose_shared_prompt(models: dict, vocab: int):
    """The first prompt seed for which every model's greedy continuation is unambiguous."""
    for seed in range(PROMPT_SEED0, PROMPT_SEED0 + 1000):
        prompt = np.random.default_rng(seed).integers(3, vocab, size=PROMPT_LEN)
        results, reason = {}, None
        for name, model in models.items():
            greedy = generate_greedy(model, prompt, NEW_TOKENS)
            ids = np.concatenate([prompt, greedy]).astype(np.int32)
            logits = forward_logits(model, ids)
            gap, distinct = greedy_margin_report(logits, greedy, PROMPT_LEN)
            if gap <= MIN_GAP or distinct < 12 or EOS_ID in greedy:
                reason = f"{name}: min gap {gap:.2e}, {distinct} distinct, eos={EOS_ID in greedy}"
                break
            results[name] = (ids, logits, gap, distinct)
        if reason is None:
            return seed, results
        print(f"  prompt seed {seed} rejected: {reason}")
    raise RuntimeError("no shared prompt seed")


def golden(ids, logits) -> dict:
    return {"input_ids": ids, "prompt_len": np.array(PROMPT_LEN, dtype=np.int32), "logits": logits}


def main() -> int:
    setup_determinism()
    base = random_model("llama", TINY_LLAMA, INIT_SEED)
    save_model(base, fresh_dir(OUT_ROOT / "base"))
    adapters = {}
    for name in ADAPTERS:
        adapters[name] = make_adapter(base, name)
        out_dir = fresh_dir(OUT_ROOT / name)
        adapters[name].save_pretrained(out_dir)
        (out_dir / "README.md").unlink(missing_ok=True)
        # PEFT keeps target_modules as a set, so its saved order follows string hashing: sort for reruns.
        cfg_file = out_dir / "adapter_config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg["target_modules"] = sorted(cfg["target_modules"])
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))

    goldens = {"base": base} | {n: adapters[n] for n, (_, _, g) in ADAPTERS.items() if g}
    seed, results = choose_shared_prompt(goldens, TINY_LLAMA["vocab_size"])
    base_ids, base_logits = results["base"][:2]
    for name, (ids, logits, gap, distinct) in results.items():
        out_dir = OUT_ROOT / name
        save_npz_deterministic(out_dir / "golden.npz", golden(ids, logits))
        print(f"{name}: min_gap={gap:.4f} distinct={distinct} greedy={ids[PROMPT_LEN:].tolist()}")
        if name == "base":
            continue
        reloaded = PeftModel.from_pretrained(copy.deepcopy(base), out_dir).eval()
        assert np.array_equal(forward_logits(reloaded, ids), logits), f"{name}: reloaded adapter differs"
        by_hand = forward_logits(merged_by_hand(base, out_dir), ids)
        assert np.allclose(by_hand, logits, atol=2e-5, rtol=0), np.abs(by_hand - logits).max()
        moved = float(np.abs(forward_logits(base, ids) - logits).max())
        changed = int((ids[PROMPT_LEN:] != base_ids[PROMPT_LEN:]).sum())
        assert moved > 0.1 and changed > 0, (name, moved, changed)
        print(f"  reload identical; hand merge max|diff| {np.abs(by_hand - logits).max():.1e}; adapter moves logits "
              f"by up to {moved:.3f}; {changed}/16 greedy tokens differ from the base's")
    print(f"shared prompt seed {seed}")
    for name in ["base", *ADAPTERS]:
        print(name)
        if name != "base":
            cfg = json.loads((OUT_ROOT / name / "adapter_config.json").read_text())
            print("  " + json.dumps({k: cfg[k] for k in ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules",
                                                          "modules_to_save", "base_model_name_or_path")}))
        list_dir(OUT_ROOT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
