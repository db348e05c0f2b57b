"""The abstract model: every parameter's path, shape, dtype and place on the mesh, with no array anywhere.

One object, made once from the model's config, the weights' dtype, the mesh plan and the layout of the
linear layers, answers every question about the model's shape; nothing here reads or allocates weights.
1. `module`: the full model built abstractly (`model/registry.py`); `params`: each parameter's path and
   `jax.ShapeDtypeStruct`, in the module's order.
2. `entries`: each parameter's layout on the mesh from the partition rules (`sharding/rules.py`): padded
   shape, PartitionSpec, and where it lives (a layer's parameters on its pipeline stage's devices, the
   embedding, final norm and LM head on every stage).
3. `place(arrays)` stacks the pipeline stages' layers into the stage model the steps run
   (`placement.assemble`); `shapes()` is that model with shapes where the arrays would be.
4. Its users: serving fills the entries from a checkpoint's reader and places them (`load.py`);
   compile-only planning takes `shapes()` (`jaxserve plan`); conversion writes `params` in order (mapped)
   or the entries read onto a mesh (Orbax), and the feature-major layout is read off a turned abstract
   model (`turned.py`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.loader.placement import ParamEntry, ShardedModel, assemble
from jaxserve.loader.tree import ParamPath, flatten
from jaxserve.model.registry import abstract_model
from sharding.mesh import MeshPlan
from sharding.rules import is_layer_param, param_layout


@dataclasses.dataclass(frozen=True, eq=False)
class AbstractModel:
    """The model `config` describes (its linear layers quantized as `config.linear_quantization` says) in
    `dtype`, placed by `plan`. `feature_major`: the linear layers turned as a CPU runs them
    (`model/feature_major.py`). `pad`: a dimension that does not split evenly is padded (serving); else
    kept whole (an Orbax checkpoint, which must not depend on the mesh that wrote it)."""
    config: ModelConfig
    dtype: object
    plan: MeshPlan | None = None  # None: no mesh (`params` and `module` only)
    feature_major: bool = False
    pad: bool = True

    @functools.cached_property
    def module(self) -> nnx.Module:
        return abstract_model(self.config, self.dtype, self.feature_major)

    @functools.cached_property
    def params(self) -> list[tuple[ParamPath, jax.ShapeDtypeStruct]]:
        return module_specs(self.module)

    @functools.cached_property
    def entries(self) -> list[ParamEntry]:
        if self.plan is None:
            raise ValueError("an abstract model without a mesh plan has no placement")
        mesh_shape = dict(self.plan.mesh.shape)
        entries = []
        for path, spec in self.params:
            layout = param_layout(path, tuple(spec.shape), mesh_shape, pad=self.pad,
                                  expert_parallel=self.plan.expert_parallel)
            mesh = (self.plan.stage_mesh(int(path[1]) // self.plan.layers_per_stage) if is_layer_param(path)
                    else self.plan.mesh)
            entries.append(ParamEntry(path, layout, spec.dtype, NamedSharding(mesh, layout.spec)))
        return entries

    def place(self, arrays: dict[ParamPath, jax.Array]) -> ShardedModel:
        """The stage model holding `arrays`, one per entry, each on its entry's sharding."""
        return assemble(arrays, self.config, self.dtype, self.plan, self.feature_major)

    def shapes(self) -> ShardedModel:
        """The model as loading places it, with `jax.ShapeDtypeStruct`s (shape, dtype, sharding) where the
        arrays would be: what compiling a step needs of the weights. It works for a mesh of compile-only
        devices and a model of any size."""
        return self.place({e.path: jax.ShapeDtypeStruct(e.layout.padded, e.dtype, sharding=e.sharding)
                           for e in self.entries})


def module_specs(module: nnx.Module) -> list[tuple[ParamPath, jax.ShapeDtypeStruct]]:
    """Every parameter of `module` (abstract or not): (path, its value), in the module's order."""
    _, state = nnx.split(module)
    return [(tuple(str(p) for p in path), spec) for path, spec in flatten(nnx.to_pure_dict(state))]
