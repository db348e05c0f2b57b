"""How XLA's CPU backend runs a decoder's weight matmuls, by weight layout and token count.

The 124.7M test Llama's matmuls alone (12 layers of q/k/v/o and gate/up/down, then the 32000-way LM head,
float32), jitted as one chain, at 1, 16, 128 and 512 tokens, three ways:
1. `x @ W` with W stored [in, out] (Flax's layout, what the engine uses);
2. `(W @ x.T).T` with W stored [out, in] (PyTorch's layout);
3. `W @ X` with W stored [out, in] and activations kept [features, tokens] throughout.
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


def chain(linear, pad):
    """The decoder's matmul chain with `linear(w, x)`; `pad` widens k + v to the hidden size."""
    def run(layers, head, x):
        for p in layers:
            q, k, v = linear(p["q"], x), linear(p["k"], x), linear(p["v"], x)
            x = x + linear(p["o"], q + pad(k + v)) * 0.01
            x = x + linear(p["d"], jax.nn.silu(linear(p["g"], x)) * linear(p["u"], x)) * 0.01
        return linear(head, x)
    return jax.jit(run)


VARIANTS = {
    "x @ W, W [in, out]": (False, False, chain(lambda w, x: x @ w,
                                               lambda a: jnp.pad(a, ((0, 0), (0, HIDDEN - KV))))),
    "(W @ x.T).T, W [out, in]": (True, False, chain(lambda w, x: (w @ x.T).T,
                                                    lambda a: jnp.pad(a, ((0, 0), (0, HIDDEN - KV))))),
    "W @ X, W [out, in], X [features, tokens]": (True, True, chain(lambda w, x: w @ x,
                                                                   lambda a: jnp.pad(a, ((0, HIDDEN - KV), (0, 0))))),
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
