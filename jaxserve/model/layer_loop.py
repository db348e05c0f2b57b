"""How a step program runs a decoder's layers: unrolled, or as one period of layers under `lax.scan`.

1. Unrolled: a Python loop, so the program holds a copy of the layer's code per layer and its compile
   time grows with depth (35-43 s for all programs of a 16-layer 1.1B model on the development machine).
2. Scanned: the module holds one *period* of layers — the shortest run of layers that repeats through the
   stage (1 for Llama, Qwen and Mixtral; 2 for Gemma 2's sliding and global pair; 6 for Gemma 3's 5 : 1;
   the whole stack when nothing repeats, e.g. a MoE whose `mlp_only_layers` break the pattern, which is
   then unrolled) — and each parameter of the period's layers stacked over its `repeats`. `lax.scan` runs
   the period `repeats` times, so the program holds one period whatever the depth.
3. Unrolled layers keep a KV array each; scanned ones share one array of every layer's block of pages
   (`KVCache`), where layer i, a traced value, offsets page ids and slots (one add), never copies pages.

Which runs faster differs per backend, and `auto` keeps the faster one where it was measured: XLA:CPU
copies each scanned layer's weight slice out of the stack before its matmuls (a decode step reads every
weight twice), so CPUs unroll; on an H200, unrolled decode steps of an 8-layer Llama-3-8B-shaped model ran
1.10-1.27x faster than scanned ones (4.78 against 6.07 ms at one sequence), so GPUs unroll too and pay
for it in compile time. TPUs scan (not measured here; MaxText scans its layers by default).
docs/performance.md has the measurements.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import LAYER_LOOPS
from jaxserve.model.kv_cache import KVCache

# run_layer(layer_index, layer_module, x, k_pages, v_pages, write_index, attend) -> (x, k_pages, v_pages)
RunLayer = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def resolve_layer_loop(choice: str, platform: str) -> str:
    if choice not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {choice!r}")
    if choice != "auto":
        return choice
    return "scan" if platform == "tpu" else "unroll"


def run_layers(layers: Sequence[nnx.Module], repeats: int, x: jax.Array, kv_cache: KVCache, write_index,
               attend, run_layer: RunLayer) -> tuple[jax.Array, KVCache]:
    """Layers 0 .. len(layers) * repeats - 1 over hidden x. `layers`: every layer (repeats 1; the cache a
    list of each layer's pages), or one period whose parameters are stacked [repeats, ...] (the cache
    folded, `KVCache.abstract`; `jaxserve/loader/placement.py`'s `scan_layers` makes the stacks)."""
    if repeats == 1:  # unrolled: each layer its own pages
        k, v = list(kv_cache.k), list(kv_cache.v)
        own_pages = functools.partial(attend, first_page=0)
        for i, layer in enumerate(layers):
            x, k[i], v[i] = run_layer(i, layer, x, k[i], v[i], write_index, own_pages)
        return x, dataclasses.replace(kv_cache, k=k, v=v)

    period = len(layers)
    graphdefs, states = zip(*(nnx.split(layer) for layer in layers))

    def body(carry, xs):  # one period of layers; their pages are blocks of the folded cache
        (x, k, v), (t, period_states) = carry, xs
        for r, (graphdef, state) in enumerate(zip(graphdefs, period_states)):
            slots, layer_attend = kv_cache.for_layer(t * period + r, write_index, attend)
            x, k, v = run_layer(t * period + r, nnx.merge(graphdef, state), x, k, v, slots, layer_attend)
        return (x, k, v), None

    (x, k, v), _ = jax.lax.scan(body, (x, kv_cache.k, kv_cache.v), (jnp.arange(repeats, dtype=jnp.int32), states))
    return x, dataclasses.replace(kv_cache, k=k, v=v)


def layer_period(layer_graphdefs: Sequence) -> int:
    """The shortest period p dividing the number of layers such that layer i has layer i % p's graph."""
    n = len(layer_graphdefs)  # p = n always qualifies: a stack that never repeats is its own period
    return next(p for p in range(1, n + 1)
                if n % p == 0 and all(layer_graphdefs[i] == layer_graphdefs[i % p] for i in range(n)))
