"""The LoRA term of a projection inside the step: `(x @ A[slot]) @ B[slot]` for each token's slot.

1. The step gives every token of the ragged batch a slot (`StepBatch.lora_slot`; 0 = no adapter, whose
   A and B are zeros).
2. Per layer, `LoRAInputs.layer(i)` hands the model that layer's stacks; per projection the model calls
   `project` (or `delta`) once (`jaxserve/model/llama.py`): each token gathers its own slot's A
   ([slots, in, R]) and B ([slots, R, out], the scale folded in) and contracts with them. The work is
   one rank-R adapter per token whatever `max_loras` is; a grouped matmul (`lax.ragged_dot`) was slower
   and, on XLA:CPU, grew with the number of slots. With few slots (`DENSE_SLOTS`) and a bucket of at
   least as many tokens, reading every slot once beats a copy per token: the tokens go through all
   slots' A side by side, keep their own block and meet B in one matmul (docs/lora.md has the numbers).
3. Under tensor parallelism a column-parallel projection (q/k/v, gate/up) holds B split like its output;
   a row-parallel one (o, down) holds A split like its input, so its term is a partial sum that the
   caller adds before the all-reduce (`parallel.row_parallel`'s `extra`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


# Up to this many slots (max_loras + 1), and in buckets of at least as many tokens, the term reads every
# slot's A and B once rather than a copy per token (docs/lora.md: fewer bytes and matmuls instead of
# gathers); beyond it, the per-token gather, whose cost follows the tokens whatever max_loras is.
DENSE_SLOTS = 8


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

    def layer(self, index) -> LayerLoRA:
        """Layer `index`'s stacks: an int on per-layer lists, a traced int on `stacked()` ones."""
        if isinstance(self.stack.a, dict):
            return LayerLoRA(jax.tree.map(lambda s: s[index], self.stack.a),
                             jax.tree.map(lambda s: s[index], self.stack.b), self.token_slots)
        return LayerLoRA(self.stack.a[index], self.stack.b[index], self.token_slots)

    def stacked(self) -> LoRAInputs:
        """The per-layer lists as one [layers, slots, ...] array per module, for layers under `lax.scan`.
        A copy of the adapters' slots inside every step: with 4 slots of rank 16 on every projection of a
        Llama-3-8B-shaped layer, 9 MB in bf16 against the layer's 436 MB of weights (2%)."""
        stack = lambda layers: {name: jnp.stack([layer[name] for layer in layers]) for name in layers[0]}
        return LoRAInputs(LoRAStack(stack(self.stack.a), stack(self.stack.b)), self.token_slots)


def delta(lora: LayerLoRA | None, name: str, x: jax.Array) -> jax.Array | None:
    """x [T, in] -> the LoRA term [T, out] of projection `name`, or None (no LoRA in this step, or the
    stacks do not hold that projection)."""
    if lora is None or name not in lora.a:
        return None
    a, b = lora.a[name], lora.b[name]
    slots, d_in, rank = a.shape
    dtype, x = x.dtype, x.astype(a.dtype)
    if slots <= DENSE_SLOTS and slots <= x.shape[0]:
        # Every token through every slot's A (one matmul over the slots side by side), its own slot's
        # rank-R block kept, then one matmul with B: reads each slot once instead of a copy per token.
        u = (x @ jnp.moveaxis(a, 0, 1).reshape(d_in, slots * rank)).reshape(-1, slots, rank)
        own = lora.token_slots[:, None] == jnp.arange(slots, dtype=lora.token_slots.dtype)
        u = jnp.where(own[..., None], u, 0).reshape(-1, slots * rank)
        return (u @ b.reshape(slots * rank, -1)).astype(dtype)
    u = jnp.einsum("ti,tir->tr", x, a[lora.token_slots])
    return jnp.einsum("tr,tro->to", u, b[lora.token_slots]).astype(dtype)


def project(linear, x: jax.Array, lora: LayerLoRA | None, name: str) -> jax.Array:
    """A column-parallel projection with its LoRA term (the model's hook: one call per projection)."""
    y = linear(x)
    d = delta(lora, name, x)
    return y if d is None else y + d
