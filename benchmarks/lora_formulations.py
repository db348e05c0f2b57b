"""Which formulation of the batched LoRA term to use in the step (issue 31): measured on one projection.

The term is `(x @ A[slot]) @ B[slot]` for each token of a ragged batch, slots 1..max_loras holding
adapters (0: none). Three ways to write it, timed (jitted, median of runs) at the 124.7M model's width
(768 -> 768, rank 16), for a decode-sized and a prefill-sized step and two max_loras:
- `segment`: tokens sorted by slot, `lax.ragged_dot` against A then B, unsorted (what the step uses);
- `gather`: each token gathers its own A and B (`A[slot]`: a [T, in, R] copy) and contracts with them;
- `dense`: every token through every slot's A and B, masked to its own (the cost follows max_loras).

    .venv/bin/python benchmarks/lora_formulations.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

HIDDEN, RANK = 768, 16


def segment(x, a, b, slots):
    order = jnp.argsort(slots, stable=True)
    sizes = jnp.zeros(a.shape[0], jnp.int32).at[slots].add(1)
    u = jax.lax.ragged_dot(x[order], a, sizes)
    d = jax.lax.ragged_dot(u, b, sizes)
    return jnp.zeros_like(d).at[order].set(d)


def gather(x, a, b, slots):
    u = jnp.einsum("ti,tir->tr", x, a[slots])
    return jnp.einsum("tr,tro->to", u, b[slots])


def dense(x, a, b, slots):
    g, _, r = a.shape
    u = (x @ a.transpose(1, 0, 2).reshape(x.shape[1], g * r)).reshape(-1, g, r)
    u = u * (jnp.arange(g) == slots[:, None])[..., None]
    return u.reshape(-1, g * r) @ b.reshape(g * r, -1)


def timed(fn, *args, runs: int = 30) -> float:
    fn = jax.jit(fn)
    fn(*args).block_until_ready()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"backend {jax.default_backend()}, {HIDDEN} -> {HIDDEN}, rank {RANK}; microseconds per call")
    print("| tokens | max_loras | segment | gather | dense | base matmul |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in (16, 256):
        for max_loras in (4, 16):
            x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)
            a = jnp.asarray(rng.standard_normal((max_loras + 1, HIDDEN, RANK)), jnp.float32)
            b = jnp.asarray(rng.standard_normal((max_loras + 1, RANK, HIDDEN)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((HIDDEN, HIDDEN)), jnp.float32)
            slots = jnp.asarray(rng.integers(0, max_loras + 1, tokens), jnp.int32)
            ref = np.asarray(gather(x, a, b, slots))
            for fn in (segment, dense):
                np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, a, b, slots)), ref, rtol=2e-4, atol=2e-3)
            row = [timed(fn, x, a, b, slots) for fn in (segment, gather, dense)]
            base = timed(lambda x, w: x @ w, x, w)
            print(f"| {tokens} | {max_loras} | " + " | ".join(f"{t:.0f}" for t in row) + f" | {base:.0f} |")


if __name__ == "__main__":
    main()
