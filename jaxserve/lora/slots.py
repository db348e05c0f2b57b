"""The adapters' weights on the device: fixed-shape stacks of `max_loras + 1` slots, written in place.

1. `LoRASlots` creates, per layer and target projection, A [slots, in, R] and B [slots, R, out] (R =
   `max_lora_rank`) as zeros, laid out on the mesh like their base layer (`sharding/rules.py`'s
   `lora_specs`: B split like a column-parallel output, A like a row-parallel input). Slot 0 stays zero:
   the slot of tokens with no adapter.
2. `write(slot, adapter)` pads the adapter's A and B to R (zero columns and rows add nothing) and to the
   layer's padded sizes, and copies them into the slot with one jitted, donating update whose slot index
   is an argument: loading any adapter into any slot runs the same program, compiled once at start
   (`warm_up`), and the step program, which takes the stacks as an input, never changes.
3. `write(slot, None)` zeroes a slot, so a stale adapter can never leak into a later one of lower rank.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.lora.adapter import MODULE_BLOCKS, TARGET_MODULES, LoRAAdapter, module_shape
from jaxserve.lora.delta import LoRAStack
from sharding import MeshPlan
from sharding.loading import zeros
from sharding.rules import lora_layouts


# The families whose projections carry the LoRA hook (model/llama.py); Gemma's and the MoE layers' do not yet.
LORA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class LoRASlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype, plan: MeshPlan,
                 modules: tuple[str, ...] = TARGET_MODULES):
        self.num_slots = max_loras + 1
        self.max_rank = max_rank
        self.dtype = dtype
        self.modules = modules
        # module -> (A padded [in, R] layout, B padded [R, out] layout), the same for every layer
        self._layouts = _module_layouts(config, max_rank, plan, modules)
        self._value_shardings = {m: (NamedSharding(plan.mesh, a.spec), NamedSharding(plan.mesh, b.spec))
                                 for m, (a, b) in self._layouts.items()}
        shapes = self.abstract_stack(config, max_loras, max_rank, dtype, plan, modules)
        self.stack = jax.tree.map(lambda a: zeros(a.shape, a.dtype, a.sharding), shapes)
        shardings = jax.tree.map(lambda x: x.sharding, self.stack)
        self._write = jax.jit(_write_slot, donate_argnums=0, out_shardings=shardings)
        self.num_layers = config.num_layers

    @staticmethod
    def abstract_stack(config: ModelConfig, max_loras: int, max_rank: int, dtype, plan: MeshPlan,
                       modules: tuple[str, ...] = TARGET_MODULES) -> LoRAStack:
        """The slot stacks as shapes and shardings: per layer and module, A [slots, in, R] and B [slots, R,
        out] laid out like the base layer. Nothing is allocated (compiling for devices not here uses it)."""
        layouts = _module_layouts(config, max_rank, plan, modules)

        def stacked(layout) -> jax.ShapeDtypeStruct:
            spec = jax.sharding.PartitionSpec(None, *layout.spec)
            return jax.ShapeDtypeStruct((max_loras + 1, *layout.padded), dtype, sharding=NamedSharding(plan.mesh, spec))

        layers = range(config.num_layers)
        return LoRAStack(a=[{m: stacked(layouts[m][0]) for m in modules} for _ in layers],
                         b=[{m: stacked(layouts[m][1]) for m in modules} for _ in layers])

    @property
    def num_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self.stack))

    def _values(self, adapter: LoRAAdapter | None) -> tuple[list[dict], list[dict]]:
        """Per layer and module, the slot's new A and B on the device (zeros where the adapter has none)."""
        a_values, b_values = [], []
        for layer in range(self.num_layers):
            a_layer, b_layer = {}, {}
            for m in self.modules:
                a_layout, b_layout = self._layouts[m]
                a = np.zeros(a_layout.padded, self.dtype)
                b = np.zeros(b_layout.padded, self.dtype)
                pair = adapter.weights.get((layer, m)) if adapter is not None else None
                if pair is not None:
                    a[:pair[0].shape[0], :pair[0].shape[1]] = pair[0]
                    b[:pair[1].shape[0], :pair[1].shape[1]] = pair[1]
                a_sharding, b_sharding = self._value_shardings[m]
                a_layer[m], b_layer[m] = jax.device_put(a, a_sharding), jax.device_put(b, b_sharding)
            a_values.append(a_layer)
            b_values.append(b_layer)
        return a_values, b_values

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put `adapter` (None: nothing) into `slot` (1..max_loras). Call it between steps, on the thread
        that launches them: the stacks are donated to the update."""
        if not 0 < slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.num_slots - 1}")
        if adapter is not None:
            missing = sorted({m for _, m in adapter.weights} - set(self.modules))
            if missing:
                raise ValueError(f"adapter targets {', '.join(missing)}, which the LoRA stacks do not hold")
        a_values, b_values = self._values(adapter)
        self.stack = self._write(self.stack, np.int32(slot), a_values, b_values)

    def warm_up(self) -> None:
        """Compile the slot update (by zeroing slot 1, which holds nothing yet)."""
        if self.num_slots > 1:
            self.write(1, None)


def _module_layouts(config: ModelConfig, max_rank: int, plan: MeshPlan, modules: tuple[str, ...]) -> dict:
    if config.model_type not in LORA_MODEL_TYPES:
        raise ValueError(f"LoRA adapters are served on {', '.join(LORA_MODEL_TYPES)} models; this one is "
                         f"{config.model_type!r}")
    mesh_shape = dict(plan.mesh.shape)
    return {m: lora_layouts(MODULE_BLOCKS[m], m, module_shape(config, m), max_rank, mesh_shape) for m in modules}


def _write_slot(stack: LoRAStack, slot, a_values, b_values) -> LoRAStack:
    put = lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v.astype(s.dtype), slot, 0)
    return LoRAStack(a=jax.tree.map(put, stack.a, a_values), b=jax.tree.map(put, stack.b, b_values))

