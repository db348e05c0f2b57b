"""How XLA's CPU backend runs a decoder's weight matmuls, by weight layout and token count.

The 124.7M test Llama's matmuls alone (12 layers of q/k/v/o and gate/up/down, then the 32000-way LM head,
float32), jitted as one chain, at 1, 16, 128 and 512 tokens, these ways:
1. `x @ W` with W stored [in, out] (Flax's layout), in YNNPACK and in Eigen (`--cpu-matmul-library eigen`);
2. `(W @ x.T).T` with W stored [out, in] (PyTorch's layout): XLA folds the transposes into one dot
   contracting both operands' last axes, what `ynnpack-feature-major` runs from 64 rows up;
3. `W @ X` with W stored [out, in] and activations kept [features, tokens] throughout;
4. islands: each product `W @ x.T` between optimization barriers, the rest token-major (what
   `ynnpack-feature-major` runs below 64 rows, jaxserve/model/feature_major.py), and the same with q/k/v
   and gate/up fused into one product each, as that engine runs them.
It prints ms per step and the weight bytes read per second. This is the evidence behind the profile notes
in docs/performance.md: which layout is fastest depends on the token count, so no single layout wins.

    ./dev run python benchmarks/cpu_matmul_layout.py [TOKENS ...]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, HIDDEN, KV, MLP, VOCAB = 12, 768, 256, 2048, 32000


def weights(rng, out_in: bool):
    """Per layer q, k, v, o, gate, up, down, then the LM head; [out, in] when out_in, else [in, out]."""
    def w(n_in, n_out):
        a = rng.standard_normal((n_in, n_out), dtype=np.float32) * 0.02
        return jnp.asarray(a.T.copy() if out_in else a)
    layers = [dict(q=w(HIDDEN, HIDDEN), k=w(HIDDEN, KV), v=w(HIDDEN, KV), o=w(HIDDEN, HIDDEN),
                   g=w(HIDDEN, MLP), u=w(HIDDEN, MLP), d=w(MLP, HIDDEN)) for _ in range(LAYERS)]
    return layers, w(HIDDEN, VOCAB)


def chain(linear, pad, fused: bool = False, options: dict | None = None):
    """The decoder's matmul chain with `linear(w, x)`; `pad` widens k + v to the hidden size; `fused`: the
    layers hold `qkv` and `gu` (`fuse`), one product each."""
    def run(layers, head, x):
        for p in layers:
            if fused:
                qkv = linear(p["qkv"], x)
                q, k, v = qkv[:, :HIDDEN], qkv[:, HIDDEN:HIDDEN + KV], qkv[:, HIDDEN + KV:]
            else:
                q, k, v = linear(p["q"], x), linear(p["k"], x), linear(p["v"], x)
            x = x + linear(p["o"], q + pad(k + v)) * 0.01
            if fused:
                gu = linear(p["gu"], x)
                g, u = gu[:, :MLP], gu[:, MLP:]
            else:
                g, u = linear(p["g"], x), linear(p["u"], x)
            x = x + linear(p["d"], jax.nn.silu(g) * u) * 0.01
        return linear(head, x)
    return jax.jit(run, compiler_options=options)


def island(w, x):
    """`W @ x.T` between barriers, for W [out, in] and x [tokens, in]: the barriers keep XLA's layout
    assignment from folding the transposes into the dot (jaxserve/model/feature_major.py)."""
    return jax.lax.optimization_barrier(w @ jax.lax.optimization_barrier(x.T)).T


def fuse(layers):
    """Concatenated once, outside the timed chain: the engine stores them fused."""
    return [dict(qkv=jnp.concatenate([p["q"], p["k"], p["v"]]), o=p["o"], gu=jnp.concatenate([p["g"], p["u"]]),
                 d=p["d"]) for p in layers]


EIGEN = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
_pad_rows = lambda a: jnp.pad(a, ((0, 0), (0, HIDDEN - KV)))  # noqa: E731


VARIANTS = {
    "x @ W, W [in, out]": (False, False, chain(lambda w, x: x @ w, _pad_rows)),
    "x @ W, Eigen": (False, False, chain(lambda w, x: x @ w, _pad_rows, options=EIGEN)),
    "(W @ x.T).T, W [out, in]": (True, False, chain(lambda w, x: (w @ x.T).T, _pad_rows)),
    "W @ X, W [out, in], X [features, tokens]": (True, True, chain(lambda w, x: w @ x,
                                                                   lambda a: jnp.pad(a, ((0, HIDDEN - KV), (0, 0))))),
    "islands, W [out, in]": (True, False, chain(island, _pad_rows)),
    "islands, q/k/v and gate/up fused": ("fused", False, chain(island, _pad_rows, fused=True)),
}


def seconds_per_call(fn, *args, calls: int = 20, repeats: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    tokens = [int(t) for t in (sys.argv[1:] if argv is None else argv)] or [1, 16, 128, 512]
    rng = np.random.default_rng(0)
    nbytes = (LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * MLP) + HIDDEN * VOCAB) * 4
    stored = {out_in: weights(rng, out_in) for out_in in (False, True)}
    stored["fused"] = (fuse(stored[True][0]), stored[True][1])
    print(f"JAX {jax.__version__} on {jax.default_backend()}, weights {nbytes / 1e6:.0f} MB float32")
    print("| tokens | " + " | ".join(VARIANTS) + " |")
    print("|---:|" + "---:|" * len(VARIANTS))
    for t in tokens:
        cells = []
        for out_in, columns, fn in VARIANTS.values():
            x = jnp.asarray(rng.standard_normal((HIDDEN, t) if columns else (t, HIDDEN), dtype=np.float32))
            s = seconds_per_call(fn, *stored[out_in], x)
            cells.append(f"{s * 1e3:.2f} ms ({nbytes / s / 1e9:.0f} GB/s)")
        print(f"| {t} | " + " | ".join(cells) + " |", flush=True)
    print("Reproduce: ./dev run python benchmarks/cpu_matmul_layout.py " + " ".join(map(str, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
