"""How to run the experts of a step on this backend: `ragged_dot` against the tiled loop of
`jaxserve.model.moe` over the stacked experts and over the experts held apart (`SplitExperts`: gate and up
side by side, each tile's expert picked by lax.switch), with the dense product over all experts (what
masking would cost) for scale.

    .venv/bin/python benchmarks/moe_grouped_ffn.py [--hidden 1024 --inter 384 --experts 64 --top 8]

Prints milliseconds per call (median of --repeats) for a decode-sized and a prefill-sized step; the
routing is uniform random, so a decode step touches about tokens * top distinct experts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.moe import grouped_ffn


def dense_all_experts(rows, group_sizes, w_gate, w_up, w_down, act):
    """Every row through every expert, the other experts' outputs masked away: E times the work."""
    expert = jnp.repeat(jnp.arange(w_gate.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
    h = act(jnp.einsum("ah,ehi->aei", rows, w_gate)) * jnp.einsum("ah,ehi->aei", rows, w_up)
    out = jnp.einsum("aei,eih->aeh", h, w_down)
    return jnp.take_along_axis(out, expert[:, None, None], axis=1)[:, 0]


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    e, h, i = args.experts, args.hidden, args.inter
    w_gate, w_up = (jnp.asarray(rng.normal(size=(e, h, i)) * 0.02, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(e, i, h)) * 0.02, jnp.float32)
    print(f"backend {jax.default_backend()}, {e} experts, top {args.top}, hidden {h}, expert inter {i}")
    apart = (tuple(jnp.concatenate([w_gate[x], w_up[x]], axis=-1) for x in range(e)), None, tuple(w_down))
    print("| tokens | assignments | active experts | tiled ms | tiled, experts apart ms | ragged_dot ms "
          "| dense all-experts ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.tokens:
        chosen = np.stack([rng.choice(e, args.top, replace=False) for _ in range(n)]).reshape(-1)
        sizes = jnp.asarray(np.bincount(chosen, minlength=e), jnp.int32)
        rows = jnp.asarray(rng.normal(size=(n * args.top, h)), jnp.float32)
        cells = []
        stacked = (w_gate, w_up, w_down)
        for method, weights in (("tiled", stacked), ("tiled", apart), ("ragged_dot", stacked)):
            fn = jax.jit(lambda *a, method=method: grouped_ffn(*a, jax.nn.silu, method))
            cells.append(timed(fn, rows, sizes, *weights, repeats=args.repeats))
        dense = jax.jit(lambda *a: dense_all_experts(*a, jax.nn.silu))  # weights are arguments: no folding
        cells.append(timed(dense, rows, sizes, w_gate, w_up, w_down, repeats=args.repeats)
                     if n * args.top <= 512 else float("nan"))
        print(f"| {n} | {n * args.top} | {len(set(chosen.tolist()))} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
