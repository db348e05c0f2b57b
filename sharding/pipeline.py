"""Pipeline schedule over the `pipeline` mesh axis, for use inside `shard_map`.

Each stage holds a contiguous block of layers. The batch (decode slots, or the tokens of a prefill
chunk) is cut into M microbatches, and at time step t stage s works on microbatch t - s:
1. stage 0 takes microbatch t's embedded input; every other stage takes what its predecessor produced
   at step t - 1, received with `ppermute` (one activation hop per step, neighbour to neighbour);
2. a stage whose microbatch index is out of range (the fill and drain of the pipeline) still runs, so
   every device executes the same program, but the `valid` flag tells it to write its K/V to the null
   page, so the bubble never touches real cache entries;
3. after M + pp - 1 steps the last stage holds every microbatch's output; a masked `psum` over the
   pipeline axis hands it to all stages, which then compute logits and sample identically.
Stages overlap: while stage 1 runs microbatch 0, stage 0 already runs microbatch 1. The idle fraction is
(pp - 1) / (M + pp - 1). Prefill microbatches are consecutive slices of one sequence; causal attention
only looks back, and earlier slices pass each stage first, so their K/V is already in the cache.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from sharding.mesh import PIPELINE

# stage_fn(x, m, valid, carry) -> (y, carry): this stage's layers on microbatch m (traced int32 scalar)
StageFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def num_microbatches(batch: int, pp: int) -> int:
    """pp microbatches when the batch splits evenly (the shapes are fixed buckets), else one."""
    return pp if pp > 1 and batch % pp == 0 else 1


def run_pipeline(stage_fn: StageFn, first_input: Callable[[int], jax.Array], num_micro: int, carry: Any,
                 pp: int) -> tuple[jax.Array, Any]:
    """Returns ([num_micro, ...] last-stage outputs, identical on every stage; the final carry)."""
    if pp == 1:
        outputs = []
        for m in range(num_micro):
            y, carry = stage_fn(first_input(m), jnp.int32(m), jnp.bool_(True), carry)
            outputs.append(y)
        return jnp.stack(outputs), carry

    stage = jax.lax.axis_index(PIPELINE)
    forward = [(s, s + 1) for s in range(pp - 1)]
    received = jnp.zeros_like(first_input(0))
    outputs: list[jax.Array | None] = [None] * num_micro
    steps = num_micro + pp - 1
    for t in range(steps):
        micro = t - stage
        valid = (micro >= 0) & (micro < num_micro)
        x = jnp.where(stage == 0, first_input(min(t, num_micro - 1)), received)
        y, carry = stage_fn(x, jnp.clip(micro, 0, num_micro - 1).astype(jnp.int32), valid, carry)
        if t >= pp - 1:  # the last stage finished microbatch t - (pp - 1)
            outputs[t - (pp - 1)] = y
        if t < steps - 1:
            received = jax.lax.ppermute(y, PIPELINE, forward)
    stacked = jnp.stack(outputs)
    # Only the last stage's values are real; adding exact zeros from the others keeps them bit-identical.
    return jax.lax.psum(jnp.where(stage == pp - 1, stacked, jnp.zeros_like(stacked)), PIPELINE), carry
