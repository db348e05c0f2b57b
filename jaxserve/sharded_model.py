"""A model placed on the device mesh: planned from the partition rules, filled shard by shard.

1. `param_entries` walks the abstract full model (no memory) and, per parameter, takes its layout from
   the rule table (`sharding/rules.py`): padded shape, PartitionSpec, and where it lives — a layer's
   parameters on its pipeline stage's devices, the embedding, final norm and LM head on every stage.
2. A source fills each entry: Hugging Face safetensors (each device's slice via `get_slice`), an
   in-memory module, or an Orbax checkpoint restored straight into those shardings (`checkpoint.py`).
3. `assemble` relabels the stages' copies of each layer slot as one array stacked along dim 0 over the
   pipeline axis (no copy) and merges them into the state of a *stage model*: the same Llama class with
   `layers_per_stage` layers, whose graph the jitted steps merge inside `shard_map`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.config import ModelConfig
from jaxserve.weights import ModuleReader, SafetensorsReader, _flatten, abstract_model, loading_progress
from sharding.loading import array_from_reader, stack_stages
from sharding.mesh import MeshPlan
from sharding.rules import ParamLayout, is_layer_param, param_layout, runtime_spec

logger = logging.getLogger(__name__)

Path_ = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    path: Path_  # ("layers", "3", "self_attn", "q_proj", "kernel")
    layout: ParamLayout
    dtype: object
    sharding: NamedSharding  # on the stage's sub-mesh (layers) or the whole mesh


@dataclasses.dataclass
class ShardedModel:
    plan: MeshPlan
    config: ModelConfig  # the full model
    graphdef: nnx.GraphDef  # one pipeline stage's model (layers_per_stage layers)
    params: nnx.State  # runtime arrays on plan.mesh
    dtype: object

    @property
    def shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.params)

    @property
    def specs(self):
        return jax.tree.map(lambda a: a.sharding.spec, self.params)

    @property
    def num_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params))


def stage_config(config: ModelConfig, plan: MeshPlan) -> ModelConfig:
    return dataclasses.replace(config, num_layers=plan.layers_per_stage)


def param_entries(config: ModelConfig, dtype, plan: MeshPlan, pad: bool = True) -> list[ParamEntry]:
    _, state = nnx.split(abstract_model(config, dtype))
    mesh_shape = dict(plan.mesh.shape)
    entries = []
    for path, spec in _flatten(nnx.to_pure_dict(state)):
        path = tuple(str(p) for p in path)
        layout = param_layout(path, tuple(spec.shape), mesh_shape, pad=pad)
        mesh = plan.stage_mesh(int(path[1]) // plan.layers_per_stage) if is_layer_param(path) else plan.mesh
        entries.append(ParamEntry(path, layout, spec.dtype, NamedSharding(mesh, layout.spec)))
    return entries


# Parameters filled at once: copying and transposing tiles release the GIL, so threads overlap them with
# page faults and host-to-device transfers. Each holds one parameter's host buffer at most.
LOADER_THREADS = min(4, os.cpu_count() or 1)


def fill_from_reader(entries: list[ParamEntry], source) -> dict[Path_, jax.Array]:
    def load(e: ParamEntry) -> jax.Array:
        fill = source.reader(e.path, e.layout.shape)
        return array_from_reader(e.layout.shape, e.layout.padded, e.sharding, e.dtype, fill,
                                 source.in_place(e.path, e.dtype))

    # Biggest first: a big tensor left for the end loads on one thread while the others idle (the 262 MB LM
    # head of a 1B model, last in parameter order, was a second of one thread's work after all the rest).
    biggest_first = sorted(entries, key=lambda e: -math.prod(e.layout.padded) * np.dtype(e.dtype).itemsize)
    arrays = {}
    try:
        with ThreadPoolExecutor(LOADER_THREADS) as pool, loading_progress(len(entries)) as bar:
            futures = {pool.submit(load, e): e.path for e in biggest_first}
            try:
                for done in as_completed(futures):
                    arrays[futures[done]] = done.result()
                    bar.update()
            except BaseException:  # a bad tensor (or ^C) stops the loading now, not after every other tensor
                pool.shutdown(cancel_futures=True)
                raise
    finally:
        source.close()
    return arrays


def assemble(arrays: dict[Path_, jax.Array], config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    graphdef, state = nnx.split(abstract_model(stage_config(config, plan), dtype))
    runtime = nnx.to_pure_dict(state)
    for path, _ in list(_flatten(runtime)):
        key = tuple(str(p) for p in path)
        if is_layer_param(key):
            slot, rest = int(key[1]), key[2:]
            pieces = []
            for stage in range(plan.pp):
                layer = plan.layer_at(stage, slot)
                pieces.append(None if layer is None else arrays.pop(("layers", str(layer)) + rest))
            template = next(p for p in pieces if p is not None)
            value = stack_stages(pieces, plan, runtime_spec(key, template.sharding.spec, template.ndim))
        else:
            value = arrays.pop(key)
        _set(runtime, path, value)
    nnx.replace_by_pure_dict(state, runtime)
    return ShardedModel(plan=plan, config=config, graphdef=graphdef, params=state, dtype=dtype)


def shard_module(module: nnx.Module, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """An in-memory (unsharded) module onto the mesh: the demo model, tests."""
    return assemble(fill_from_reader(param_entries(config, dtype, plan), ModuleReader(module)), config, dtype, plan)


def load_sharded(model_dir: str | Path, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """Hugging Face safetensors or an Orbax checkpoint (`jaxserve convert`), each device reading its shards."""
    from jaxserve import checkpoint

    start = time.perf_counter()
    entries = param_entries(config, dtype, plan)
    fmt = checkpoint.checkpoint_format(model_dir)
    if fmt == "orbax":
        arrays, kind = checkpoint.restore_arrays(model_dir, entries), "Orbax checkpoint"
    else:
        reader = SafetensorsReader(model_dir, own_layout=fmt == "mapped")
        arrays = fill_from_reader(entries, reader)
        kind = "safetensors" if fmt is None else f"mapped safetensors, {reader.in_place_bytes / 1e6:.1f} MB in place"
    model = assemble(arrays, config, dtype, plan)
    seconds = time.perf_counter() - start
    logger.info("weights: %d tensors, %.1f MB on the mesh, from %s (%s) as %s in %.1fs (%.2f GB/s)", len(entries),
                model.num_bytes / 1e6, model_dir, kind, jnp.dtype(dtype).name, seconds,
                model.num_bytes / 1e9 / max(seconds, 1e-9))
    return model


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
