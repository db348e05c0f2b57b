"""The LoRA term of a projection inside the step: `(x @ A[slot]) @ B[slot]` for each token's slot.

1. The step gives every token of the ragged batch a slot (`StepBatch.lora_slot`; 0 = no adapter, whose
   A and B are zeros).
2. Per layer, `LoRAInputs.layer(i)` hands the model that layer's stacks; per projection the model calls
   `project` (or `delta`) once (`jaxserve/model/llama.py`): each token gathers its own slot's A
   ([slots, in, R]) and B ([slots, R, out], the scale folded in) and contracts with them. The work is
   one rank-R adapter per token whatever `max_loras` is; a grouped matmul (`lax.ragged_dot`) was slower
   and, on XLA:CPU, grew with the number of slots (docs/lora.md has the measurements).
3. Under tensor parallelism a column-parallel projection (q/k/v, gate/up) holds B split like its output;
   a row-parallel one (o, down) holds A split like its input, so its term is a partial sum that the
   caller adds before the all-reduce (`parallel.row_parallel`'s `extra`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAStack:
    """Every slot's adapter weights on the device (slot 0: zeros, for tokens with no adapter)."""
    a: list[dict[str, jax.Array]]  # per layer: module -> [slots, in, R]
    b: list[dict[str, jax.Array]]  # per layer: module -> [slots, R, out], the adapter's scale folded in


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerLoRA:
    """One layer's stacks and the step's token slots, as the model's projections see them."""
    a: dict[str, jax.Array]
    b: dict[str, jax.Array]
    token_slots: jax.Array  # [T] int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAInputs:
    stack: LoRAStack
    token_slots: jax.Array  # [T] int32 each token's slot (0: no adapter)

    def layer(self, index: int) -> LayerLoRA:
        return LayerLoRA(self.stack.a[index], self.stack.b[index], self.token_slots)


def delta(lora: LayerLoRA | None, name: str, x: jax.Array) -> jax.Array | None:
    """x [T, in] -> the LoRA term [T, out] of projection `name`, or None (no LoRA in this step, or the
    stacks do not hold that projection)."""
    if lora is None or name not in lora.a:
        return None
    a, b = lora.a[name], lora.b[name]
    u = jnp.einsum("ti,tir->tr", x.astype(a.dtype), a[lora.token_slots])
    return jnp.einsum("tr,tro->to", u, b[lora.token_slots]).astype(x.dtype)


def project(linear, x: jax.Array, lora: LayerLoRA | None, name: str) -> jax.Array:
    """A column-parallel projection with its LoRA term (the model's hook: one call per projection)."""
    y = linear(x)
    d = delta(lora, name, x)
    return y if d is None else y + d
