"""How accurate int8 / fp8 KV pages are with one scale per token and KV head vs one per layer and head.

Not a timing: it measures error, so it can run on a busy machine.
1. Real K/V: stories260K writes the K/V of its greedy story (`Workbench`), and each layer's keys and values
   are quantized both ways. A per-(layer, head) scale gets the sequence's own absmax per head, the best a
   calibrated static scale could ever be; per-token scales need no calibration at all.
2. It prints, per page dtype and granularity, the relative RMS error of the reconstructed K and V (worst
   layer) and the spread of token absmax per head (max / median), which is what a shared scale pays for.
3. Random K/V (the kernel sweep's unit normals): attention output error of both granularities.

    ./dev run python benchmarks/kv_quant_accuracy.py [--tokens 200]
"""

from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from jaxserve import SamplingParams
from jaxserve import Workbench
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, QMAX, dequantize_kv, quantize_kv_tokens
from pallas_kernels.testing import dense_attention


def per_head_roundtrip(x: np.ndarray, dtype) -> np.ndarray:
    """x [tokens, heads, D] quantized with one scale per head (its absmax over all tokens)."""
    scale = np.abs(x).max(axis=(0, 2), keepdims=True) / QMAX[dtype]
    codes = np.clip(x / scale, -QMAX[dtype], QMAX[dtype])
    codes = np.round(codes) if dtype == jnp.int8 else np.asarray(jnp.asarray(codes).astype(dtype), np.float32)
    return codes * scale


def per_token_roundtrip(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(dequantize_kv(*quantize_kv_tokens(jnp.asarray(x), dtype)))


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))


def real_kv_errors(tokens: int) -> None:
    bench = Workbench.load("../shared/models/stories260K", max_model_len=512)
    story = bench.llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=tokens,
                                                                    ignore_eos=True))[0]
    ids = bench.tokenizer.encode("Once upon a time") + list(story.outputs[0].token_ids)
    seq = bench.new_sequence(len(ids))
    for start in range(0, len(ids), bench.max_step_tokens):
        bench.step([(seq, ids[start:start + bench.max_step_tokens])])
    layers = [bench.kv(seq, layer) for layer in range(bench.model_config.num_layers)]
    print(f"stories260K, {len(ids)} tokens of its greedy story, {len(layers)} layers")
    absmax = [np.abs(a).max(-1) for k, v in layers for a in (k, v)]  # [tokens, heads] each
    spread = max(float(np.max(a.max(0) / np.median(a, 0))) for a in absmax)
    print(f"largest (max / median) token absmax of one head: {spread:.1f}")
    print("| page dtype | scales | K relative RMS error (worst layer) | V relative RMS error (worst layer) |")
    print("|---|---|---:|---:|")
    for name, dtype in KV_CACHE_DTYPES.items():
        for label, roundtrip in (("per token and head", per_token_roundtrip), ("per layer and head", per_head_roundtrip)):
            k_err = max(relative_rms(roundtrip(k, dtype), k) for k, _ in layers)
            v_err = max(relative_rms(roundtrip(v, dtype), v) for _, v in layers)
            print(f"| {name} | {label} | {k_err:.4f} | {v_err:.4f} |")
    bench.release(seq)


def random_attention_errors(seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    t, kvh, group, d = 64, 2, 4, 64
    k, v = (rng.standard_normal((t, kvh, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((t, kvh * group, d)).astype(np.float32)
    pos = np.arange(t)
    attend = lambda kk, vv: dense_attention(q, kk.transpose(1, 0, 2), vv.transpose(1, 0, 2), pos, t,  # noqa: E731
                                            sm_scale=d ** -0.5)
    want = attend(k, v)
    print(f"random unit-normal K/V/q, {t} causal tokens, head_dim {d}: attention output error (max / RMS)")
    for name, dtype in KV_CACHE_DTYPES.items():
        cells = []
        for roundtrip in (per_token_roundtrip, per_head_roundtrip):
            diff = attend(roundtrip(k, dtype), roundtrip(v, dtype)) - want
            cells.append(f"{np.abs(diff).max():.4f} / {np.sqrt(np.mean(diff ** 2)):.4f}")
        print(f"  {name}: per token and head {cells[0]}; per layer and head {cells[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args(argv)
    real_kv_errors(args.tokens)
    random_attention_errors()
    print(f"Reproduce: ./dev run python benchmarks/kv_quant_accuracy.py --tokens {args.tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
