"""Shared helpers for the golden-fixture generators in tools/ (run under the golden venv, never the project's).

The generators (`make_parity_fixtures.py`, `make_quantized_fixtures.py`, `make_lora_fixtures.py`,
`make_embedding_fixtures.py`) all follow the same steps, and this module holds each step once:

1. `setup_determinism` pins torch to one CPU thread and deterministic kernels.
2. `reinit_weights` replaces the tiny default init with a seeded one that is large enough for logits to
   be far from flat (and for MoE routers to really route).
3. `generate_greedy` / `forward_logits` run transformers; `choose_prompt` tries prompt seeds until the
   greedy continuation has a clear top-1 / top-2 margin at every step, enough distinct tokens and no EOS.
4. `save_npz_deterministic` writes golden arrays with fixed zip timestamps, so a rerun is byte-identical;
   `list_dir` prints what was written.

Venv recipe (torch first, pinned to the CPU wheel on disk; a plain `torch` would download a CUDA build):

    /usr/bin/python3.11 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.13.0
    .venv-golden/bin/pip install transformers==5.24.0 safetensors==0.8.0 numpy==2.4.6 peft==0.21.2 \
        compressed-tensors==0.20.1 sentence-transformers==6.3.0
"""

from __future__ import annotations

import inspect
import io
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES_ROOT = REPO_ROOT / "tests" / "fixtures"

PROMPT_LEN = 48
NEW_TOKENS = 16  # tokens after the prompt covered by the stored full-forward logits
MIN_GAP = 1e-2  # top-1 / top-2 logit gap at every greedy step (headroom for TF32 / bf16 matmuls)
EOS_ID = 2  # greedy continuations never contain it, so they hold with EOS stopping too


# The Llama that the quantized and LoRA fixtures start from: GQA 4:2, head_dim 16, untied.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False, dtype="float32")


def setup_determinism() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {np.__version__}")


# --------------------------------------------------------------------------- init
def reinit_weights(model: torch.nn.Module, seed: int, *, unit_offset_norm: bool = False,
                   router_std: float = 0.5, embed_std: float = 0.5) -> None:
    """Re-initialise every parameter with a fixed seed.

    Linear weights and MoE expert tensors ~ N(0, 0.15), embeddings ~ N(0, embed_std), biases ~ N(0, 0.1),
    MoE router weights ~ N(0, router_std). RMSNorm weights (incl. q_norm / k_norm) scale by U(0.5, 1.5):
    stored as is, or, for Gemma's `x * (1 + weight)` norms (`unit_offset_norm`), stored as U(-0.5, 0.5).
    A tied lm_head shares the embedding tensor and is initialised once, as an embedding. Vision towers
    (make_vlm_fixtures.py) add: LayerNorm weights U(0.5, 1.5) and biases N(0, 0.1), patch convolutions
    N(0, 1 / fan_in) so patch embeddings stay O(1), Gemma 3's bare projection matrix as a linear weight.
    The draw order (embeddings first, then modules in definition order) is part of the fixtures'
    identity: keep it (the vision kinds only ever meet modules the text-only fixtures do not have).
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
                p.copy_(torch.randn(p.shape, generator=gen) * embed_std)
            elif kind == "bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif kind == "norm":
                p.copy_(torch.rand(p.shape, generator=gen) + (-0.5 if unit_offset_norm else 0.5))
            elif kind == "router":
                p.copy_(torch.randn(p.shape, generator=gen) * router_std)
            elif kind == "layernorm":
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif kind == "conv":
                p.copy_(torch.randn(p.shape, generator=gen) * p[0].numel() ** -0.5)
            else:  # pragma: no cover
                raise ValueError(kind)
        done.add(id(p))

    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            fill(mod.weight, "embed")
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            continue
        own = dict(mod.named_parameters(recurse=False))
        kind_name = type(mod).__name__
        if isinstance(mod, torch.nn.Linear):
            fill(mod.weight, "linear")
            if mod.bias is not None:
                fill(mod.bias, "bias")
        elif kind_name.endswith("RMSNorm"):
            assert set(own) == {"weight"}, name
            fill(mod.weight, "norm")
        elif kind_name.endswith("Experts"):  # transformers 5 keeps MoE experts as fused 3-D tensors
            assert set(own) == {"gate_up_proj", "down_proj"}, (name, set(own))
            fill(own["gate_up_proj"], "linear")
            fill(own["down_proj"], "linear")
        elif kind_name.endswith("TopKRouter"):
            assert set(own) == {"weight"}, (name, set(own))
            fill(own["weight"], "router")
        elif isinstance(mod, torch.nn.LayerNorm):
            fill(mod.weight, "layernorm")
            fill(mod.bias, "bias")
        elif isinstance(mod, (torch.nn.Conv2d, torch.nn.Conv3d)):
            fill(mod.weight, "conv")
            if mod.bias is not None:
                fill(mod.bias, "bias")
        elif kind_name == "Gemma3MultiModalProjector":
            assert set(own) == {"mm_input_projection_weight"}, (name, set(own))
            fill(own["mm_input_projection_weight"], "linear")
        else:
            assert not own, f"unhandled parameters in {name} ({kind_name}): {list(own)}"

    missing = [n for n, p in model.named_parameters() if id(p) not in done]
    assert not missing, f"parameters not re-initialised: {missing}"


def random_model(model_type: str, config: dict, seed: int, auto_class=AutoModelForCausalLM, **reinit_kwargs):
    """A float32 eager-attention model of `config`, re-initialised by `reinit_weights` with `seed`, in eval mode."""
    cfg = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = auto_class.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    reinit_weights(model, seed, **reinit_kwargs)
    return model.eval()


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


def fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (a previous run's files removed, so stale files never linger)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def save_model(model, out_dir: Path) -> None:
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out_dir, **kwargs)
    assert (out_dir / "model.safetensors").exists(), "expected a single model.safetensors"


def list_dir(out_dir: Path) -> int:
    total = 0
    for f in sorted(p for p in out_dir.rglob("*") if p.is_file()):
        size = f.stat().st_size
        total += size
        print(f"  {str(f.relative_to(out_dir)):34s} {size:>9d} bytes")
    print(f"  {'(total)':34s} {total:>9d} bytes")
    return total


# --------------------------------------------------------------------------- run
def generate_greedy(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """`model.generate` (do_sample=False, KV cache) for exactly `new_tokens` tokens after `prompt`."""
    ids = torch.tensor(prompt[None, :], dtype=torch.long)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                               pad_token_id=0, bos_token_id=1)
    # transformers 5 fills unset fields of the passed generation config from model.generation_config,
    # which would bring eos_token_id back (and stop early); clear it for the duration of generate.
    saved_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
    finally:
        model.generation_config.eos_token_id = saved_eos
    assert out.shape == (1, len(prompt) + new_tokens), out.shape
    assert np.array_equal(out[0, : len(prompt)].numpy(), prompt)
    return out[0, len(prompt):].numpy().astype(np.int32)


def forward_logits(model, ids: np.ndarray) -> np.ndarray:
    """Logits [len(ids), vocab] (float32) of one full forward over `ids` (no past: nothing cached)."""
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(ids)[None, :], dtype=torch.long))
    return out.logits[0].float().numpy().astype(np.float32)


def top_gap(logits_row: np.ndarray) -> float:
    top2 = np.sort(logits_row)[-2:]
    return float(top2[1] - top2[0])


def greedy_margin_report(logits: np.ndarray, greedy: np.ndarray, prompt_len: int) -> tuple[float, int]:
    """Check greedy == argmax of the full-forward logits; return (min top-1/top-2 gap, distinct tokens)."""
    steps = logits[prompt_len - 1: prompt_len - 1 + len(greedy)]
    assert np.array_equal(steps.argmax(-1), greedy), (steps.argmax(-1), greedy)
    return min(top_gap(row) for row in steps), len(set(greedy.tolist()))


def choose_prompt(model, vocab: int, seed0: int, new_tokens: int, min_distinct: int,
                  extra_check: Callable[[np.ndarray], str | None] | None = None,
                  prompt_len: int = PROMPT_LEN):
    """Try prompt seeds seed0, seed0+1, ... until the greedy continuation is unambiguous.

    A prompt is accepted when, for the `new_tokens` greedy tokens of `model.generate`, the logits of one
    full forward over prompt + greedy agree on every argmax with a top-1/top-2 gap > MIN_GAP, at least
    `min_distinct` tokens differ, no token is EOS, and `extra_check(full_ids)` returns None (else a reason).
    Returns (seed, prompt, greedy, full-forward logits over prompt + greedy, min gap, distinct count).
    """
    for seed in range(seed0, seed0 + 1000):
        prompt = np.random.default_rng(seed).integers(3, vocab, size=prompt_len)
        greedy = generate_greedy(model, prompt, new_tokens)
        full_ids = np.concatenate([prompt, greedy])
        logits = forward_logits(model, full_ids)
        gap, distinct = greedy_margin_report(logits, greedy, prompt_len)
        reason = None
        if gap <= MIN_GAP or distinct < min_distinct or EOS_ID in greedy:
            reason = f"min gap {gap:.2e}, {distinct} distinct, eos={EOS_ID in greedy}"
        elif extra_check is not None:
            reason = extra_check(full_ids)
        if reason is None:
            return seed, prompt, greedy, logits, gap, distinct
        print(f"  prompt seed {seed} rejected: {reason}")
    raise RuntimeError("no prompt seed with a clear greedy margin")
