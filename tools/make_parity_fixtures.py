#!/usr/bin/env python3
"""Generate golden parity fixtures from Hugging Face transformers (PyTorch, float32).

Run with the dedicated golden venv (torch never goes into the project venv):

    /usr/bin/python3.11 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    .venv-golden/bin/python tools/make_parity_fixtures.py

For every config below it builds a tiny random model, re-initialises all weights
with a fixed seed (large enough std that logits are far from flat and RMSNorm
weights are not all ones), saves it with ``save_pretrained`` into
``tests/fixtures/parity/<name>/`` and writes ``golden.npz`` with

    input_ids   int32 [64]         48 prompt tokens + 16 greedy tokens
    prompt_len  int32 scalar       48
    logits      float32 [64, V]    logits of one full forward over all 64 tokens

The script is deterministic (fixed torch / numpy seeds, one CPU thread, fixed
zip timestamps in the npz), so rerunning it reproduces the same files.
"""

from __future__ import annotations

import copy
import inspect
import io
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_ROOT = REPO_ROOT / "tests" / "fixtures" / "parity"

PROMPT_LEN = 48
NEW_TOKENS = 16
# Prompt acceptance criteria (the next prompt seed is tried until all hold):
MIN_GAP = 1e-2  # top-1 / top-2 logit gap at every greedy step (brief asked > 1e-3; 1e-2
#                 leaves headroom for TF32 / reduced-precision matmuls on accelerators)
MIN_DISTINCT = 12  # distinct tokens among the 16 greedy ones (tied-embedding models
#                    otherwise tend to repeat one token, which makes decode checks weak)
EOS_ID = 2  # greedy continuation must not contain eos, so it also holds with eos stopping

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    dtype="float32",
)

# name -> (model_type, overrides, torch init seed, first numpy prompt seed)
FIXTURES: dict[str, tuple[str, dict, int, int]] = {
    "llama_gqa_untied": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        1001,
        0,
    ),
    "llama3_tied_headdim": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=32,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        ),
        1002,
        100,
    ),
    "llama_bias": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=False,
        ),
        1003,
        200,
    ),
    "mistral_sliding": (
        "mistral",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
        1004,
        300,
    ),
    "qwen2_bias": (
        "qwen2",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=True,
        ),
        1005,
        400,
    ),
    "qwen3_qknorm": (
        "qwen3",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=False,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
        ),
        1006,
        500,
    ),
}


# --------------------------------------------------------------------------- init
def reinit_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter with a fixed seed.

    Linear weights ~ N(0, 0.15), embeddings ~ N(0, 0.5), RMSNorm weights
    (including q_norm / k_norm) ~ U(0.5, 1.5), biases ~ N(0, 0.1).
    A tied lm_head shares the embedding tensor and is initialised once, as
    an embedding.
    """
    gen = torch.Generator().manual_seed(seed)
    done: set[int] = set()

    def fill(p: torch.Tensor, kind: str) -> None:
        if id(p) in done:
            return
        with torch.no_grad():
            if kind == "linear":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
            elif kind == "embed":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif kind == "bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif kind == "norm":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:  # pragma: no cover
                raise ValueError(kind)
        done.add(id(p))

    # Embeddings first so that a tied lm_head is treated as an embedding.
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            fill(mod.weight, "embed")
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            continue
        if isinstance(mod, torch.nn.Linear):
            fill(mod.weight, "linear")
            if mod.bias is not None:
                fill(mod.bias, "bias")
        elif type(mod).__name__.endswith("RMSNorm"):
            assert set(n for n, _ in mod.named_parameters(recurse=False)) == {"weight"}, name
            fill(mod.weight, "norm")
        else:
            own = list(mod.named_parameters(recurse=False))
            assert not own, f"unhandled parameters in {name} ({type(mod).__name__}): {own}"

    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"parameters not re-initialised: {missing}"


# --------------------------------------------------------------------------- io
def save_npz_deterministic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Like np.savez (uncompressed) but with fixed zip timestamps, so reruns are byte-identical."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.asarray(arr), allow_pickle=False)
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def save_model(model, out_dir: Path) -> None:
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out_dir, **kwargs)
    assert (out_dir / "model.safetensors").exists(), "expected a single model.safetensors"


# --------------------------------------------------------------------------- run
def build_config(model_type: str, overrides: dict):
    kw = dict(COMMON)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def greedy_and_logits(model, prompt: np.ndarray):
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    gen_cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,  # no stopping on eos: exactly NEW_TOKENS tokens
        pad_token_id=0,
        bos_token_id=1,
    )
    # transformers 5 fills unset (None) fields of the passed generation config from
    # model.generation_config, which would bring eos_token_id=2 back (and with
    # min_new_tokens it would even *suppress* eos, so greedy != argmax). Clear it on
    # the model for the duration of generate; no min_new_tokens is used.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    finally:
        model.generation_config.eos_token_id = saved_eos
    assert out.shape == (1, PROMPT_LEN + NEW_TOKENS), out.shape
    with torch.no_grad():
        full = out[0].numpy().astype(np.int32)
        logits = model(out).logits[0].float().numpy().astype(np.float32)
    return full, logits


def top_gap(logits_row: np.ndarray) -> float:
    top2 = np.sort(logits_row)[-2:]
    return float(top2[1] - top2[0])


def check_config_file(name: str, out_dir: Path, model_type: str, overrides: dict) -> dict:
    raw = json.loads((out_dir / "config.json").read_text())
    loaded = AutoConfig.from_pretrained(out_dir)
    assert raw["model_type"] == model_type
    for k, v in COMMON.items():
        if k == "dtype":
            assert str(getattr(loaded, "dtype", None)).endswith("float32"), loaded.dtype
            continue
        want = overrides.get(k, v)
        assert getattr(loaded, k) == want, (name, k, getattr(loaded, k), want)
    for k, v in overrides.items():
        got = getattr(loaded, k)
        if k == "rope_parameters":
            for rk, rv in v.items():
                assert got[rk] == rv, (name, rk, got, v)
        else:
            assert got == v, (name, k, got, v)
    return raw


def check_sliding_window(model, full_ids: np.ndarray, logits: np.ndarray, window: int) -> None:
    """The sliding window must really be active in HF: compare with a no-window copy."""
    cfg = copy.deepcopy(model.config)
    cfg.sliding_window = None
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    ref.load_state_dict(model.state_dict())
    ref.eval()
    with torch.no_grad():
        nowin = ref(torch.tensor(full_ids[None, :], dtype=torch.long)).logits[0].numpy()
    diff = np.abs(nowin - logits).max(axis=-1)
    assert np.all(diff[:window] == 0.0), f"positions < window differ: {diff[:window]}"
    assert np.all(diff[window:] > 1e-4), f"sliding window not active: {diff[window:]}"
    print(f"  sliding window check: max|diff| pos<{window}: {diff[:window].max():.2e}; "
          f"pos>={window}: min {diff[window:].min():.3f} (window active; position {window} "
          f"no longer sees token 0)")


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


def make_fixture(name: str) -> None:
    model_type, overrides, init_seed, prompt_seed0 = FIXTURES[name]
    out_dir = OUT_ROOT / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        old.unlink()

    cfg = build_config(model_type, overrides)
    torch.manual_seed(init_seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    reinit_weights(model, init_seed)
    model.eval()
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert all(p.dtype == torch.float32 for p in model.parameters())

    vocab = cfg.vocab_size
    for attempt in range(1000):
        seed = prompt_seed0 + attempt
        prompt = np.random.default_rng(seed).integers(3, vocab, size=PROMPT_LEN)
        full, logits = greedy_and_logits(model, prompt)
        greedy = full[PROMPT_LEN:]
        am = logits[PROMPT_LEN - 1 : PROMPT_LEN - 1 + NEW_TOKENS].argmax(-1)
        assert np.array_equal(am, greedy), (name, seed, am, greedy)
        gaps = [top_gap(logits[p]) for p in range(PROMPT_LEN - 1, PROMPT_LEN - 1 + NEW_TOKENS)]
        distinct = len(set(greedy.tolist()))
        if min(gaps) > MIN_GAP and distinct >= MIN_DISTINCT and EOS_ID not in greedy:
            break
        print(f"  prompt seed {seed} rejected: min gap {min(gaps):.2e}, "
              f"{distinct} distinct, eos={EOS_ID in greedy}")
    else:  # pragma: no cover
        raise RuntimeError(f"{name}: no prompt seed with a clear greedy margin")

    save_model(model, out_dir)
    raw_cfg = check_config_file(name, out_dir, model_type, overrides)

    # Reload from disk and make sure the saved checkpoint reproduces the logits exactly.
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        re_logits = reloaded(torch.tensor(full[None, :], dtype=torch.long)).logits[0].numpy()
    assert np.array_equal(re_logits, logits), np.abs(re_logits - logits).max()

    save_npz_deterministic(
        out_dir / "golden.npz",
        {
            "input_ids": full.astype(np.int32),
            "prompt_len": np.array(PROMPT_LEN, dtype=np.int32),
            "logits": logits.astype(np.float32),
        },
    )
    g = np.load(out_dir / "golden.npz")
    assert g["input_ids"].shape == (PROMPT_LEN + NEW_TOKENS,) and g["input_ids"].dtype == np.int32
    assert g["logits"].shape == (PROMPT_LEN + NEW_TOKENS, vocab) and g["logits"].dtype == np.float32
    assert int(g["prompt_len"]) == PROMPT_LEN

    if model_type == "mistral":
        check_sliding_window(model, full, logits, overrides["sliding_window"])
    rope = overrides.get("rope_parameters", {})
    if rope.get("rope_type") == "llama3":
        check_llama3_rope(model, rope, overrides["head_dim"])

    from safetensors import safe_open

    with safe_open(out_dir / "model.safetensors", "np") as f:
        keys = sorted(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in keys}
    assert dtypes == {"float32"}, dtypes
    assert ("lm_head.weight" in keys) == (not cfg.tie_word_embeddings), keys

    print(f"{name}: model_type={model_type} prompt_seed={seed} tensors={len(keys)} "
          f"min_gap={min(gaps):.4f} distinct={distinct}")
    for f_ in sorted(out_dir.iterdir()):
        print(f"  {f_.name:28s} {f_.stat().st_size:>9d} bytes")
    print(f"  greedy: {greedy.tolist()}")
    print(f"  logits[0,:4]={np.round(logits[0, :4], 4).tolist()} "
          f"logits[-1,:4]={np.round(logits[-1, :4], 4).tolist()} "
          f"std={logits.std():.3f}")
    print(f"  config keys: {sorted(raw_cfg)}")
    print(f"  bias tensors: {[k for k in keys if k.endswith('.bias') and '.0.' in k]}")
    print(f"  norm tensors: {[k for k in keys if 'norm' in k and '.0.' in k]}")


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")
    names = argv[1:] or list(FIXTURES)
    for name in names:
        make_fixture(name)
    total = sum(p.stat().st_size for p in OUT_ROOT.rglob("*") if p.is_file())
    print(f"total size under {OUT_ROOT.relative_to(REPO_ROOT)}: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
