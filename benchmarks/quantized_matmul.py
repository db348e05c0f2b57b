"""Quantized linear layers on XLA's CPU backend: which `quantized_linear` strategy is fastest, by rows.

The 124.7M test Llama's per-step matmuls (12 layers of q/k/v/o and gate/up/down, then the 32000-way LM
head; the chain of `cpu_matmul_layout.py`), jitted as one program, for 1, 2, 4, 16 and 64 rows:
1. float32 `x @ W` (the baseline every ratio is against) and bfloat16 weights;
2. int8 weights: weight-only (codes converted in the step), dynamic per-row int8 activations with an
   int8 x int8 -> int32 dot;
3. candidates for one row: int8 x int8 padded to 2 or 4 rows, with the codes stored [out, in] (W @ x),
   and int8 weight-only as a broadcast multiply and reduction (no dot at all);
4. fp8 (e4m3) weights: weight-only and fp8 x fp8 -> float32; int4 weights: weight-only.
Variants run interleaved (round robin, `--rounds` rounds of `--calls` calls each) and the table shows each
one's median ms per step and its speed as a ratio to float32 in the same round (>1 is faster). Run it
once on a quiet machine (`uptime` load below 2.5): only the ratios carry over to other machines.

    ./dev run python benchmarks/quantized_matmul.py [--rows 1 2 4 16 64] [--rounds 7] [--calls 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from cpu_matmul_layout import HIDDEN, KV, LAYERS, MLP, VOCAB, chain, weights
from jaxserve.quantization import quantize_weight, quantized_linear

PAD_KV = lambda a: jnp.pad(a, ((0, 0), (0, HIDDEN - KV)))  # noqa: E731 (the chain's k + v widening)


def _linear(strategy, min_rows=1):
    return lambda qw, x: quantized_linear(x, qw, strategy, min_rows=min_rows)


def _int8_out_in(qw, x):
    """Dynamic int8 with the codes [out, in] (PyTorch's layout) as the dot's left operand: W @ x.T."""
    x = x.astype(jnp.float32)
    row_scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127
    xq = jnp.round(x / row_scale).astype(jnp.int8)
    acc = jax.lax.dot_general(qw.codes, xq, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.T.astype(jnp.float32) * qw.scales * row_scale


def _multiply_reduce(qw, x):
    """x [M, in] @ codes [in, out] as one fused broadcast-multiply-reduce, then the column scales."""
    return jnp.sum(x[:, :, None] * qw.codes.astype(jnp.float32)[None], axis=1) * qw.scales


# name -> (weight dtype: "float32" / "bfloat16" / a quantize_weight dtype, linear(w, x), single-row only)
VARIANTS = {
    "float32": ("float32", lambda w, x: x @ w, False),
    "bfloat16 weights": ("bfloat16", lambda w, x: (x.astype(jnp.bfloat16) @ w).astype(jnp.float32), False),
    "int8 weight-only": ("int8", _linear("weight_only"), False),
    "int8 x int8 dynamic": ("int8", _linear("dynamic_int8"), False),
    "int8 x int8, 1 row padded to 2": ("int8", _linear("dynamic_int8", min_rows=2), True),
    "int8 x int8, 1 row padded to 4": ("int8", _linear("dynamic_int8", min_rows=4), True),
    "int8 x int8, W [out, in]": ("int8-out-in", _int8_out_in, True),
    "int8 multiply-reduce": ("int8", _multiply_reduce, True),
    "fp8 weight-only": ("fp8", _linear("weight_only"), False),
    "fp8 x fp8 dynamic": ("fp8", _linear("dynamic_fp8"), False),
    "int4 weight-only": ("int4", _linear("weight_only"), False),
}


def stored_weights(kind: str, layers, head):
    """The float32 [in, out] weights in the variant's storage."""
    if kind == "float32":
        return layers, head
    if kind == "bfloat16":
        cast = lambda w: w.astype(jnp.bfloat16)  # noqa: E731
    elif kind == "int8-out-in":  # codes transposed once, at load
        cast = lambda w: (lambda q: type(q)(q.codes.T.copy(), q.scales))(quantize_weight(w, "int8"))  # noqa: E731
    else:
        cast = lambda w: quantize_weight(w, kind)  # noqa: E731
    return [{name: cast(w) for name, w in layer.items()} for layer in layers], cast(head)


def ms_per_call(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    layers, head = weights(rng, out_in=False)
    stores = {kind: stored_weights(kind, layers, head) for kind in {v[0] for v in VARIANTS.values()}}
    programs = {name: chain(linear, PAD_KV) for name, (_, linear, _) in VARIANTS.items()}
    print(f"JAX {jax.__version__} on {jax.default_backend()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {LAYERS} layers, hidden {HIDDEN}, intermediate "
          f"{MLP}, vocab {VOCAB}; median of {args.rounds} interleaved rounds x {args.calls} calls")
    names = [n for n in VARIANTS]
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for rows in args.rows:
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
        active = [n for n in names if rows == 1 or not VARIANTS[n][2]]
        call_args = {n: (*stores[VARIANTS[n][0]], x) for n in active}
        for n in active:  # compile and warm up outside the timed rounds
            jax.block_until_ready(programs[n](*call_args[n]))
        times = {n: [] for n in active}
        for _ in range(args.rounds):
            for n in active:
                times[n].append(ms_per_call(programs[n], call_args[n], args.calls))
        base = statistics.median(times["float32"])
        cells = []
        for n in names:
            if n not in times:
                cells.append("")
                continue
            ms = statistics.median(times[n])
            cells.append(f"{ms:.2f} ms ({base / ms:.2f}x)")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    print("Reproduce: ./dev run python benchmarks/quantized_matmul.py --rows " + " ".join(map(str, args.rows))
          + f" --rounds {args.rounds} --calls {args.calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
