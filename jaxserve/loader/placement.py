"""Placement: the model on the device mesh, filled shard by shard from a checkpoint's reader.

1. The abstract model (`abstract.py`) gives every parameter its layout on the mesh: padded shape,
   PartitionSpec, and the devices it lives on.
2. A checkpoint reader fills those entries (`read`). Readers of tensor regions (safetensors, an in-memory
   module) share `RegionReader.read`: each device's slice is read straight into the buffer that becomes
   its array, several parameters at a time. The Orbax reader restores into the shardings itself.
3. `assemble` relabels the stages' copies of each layer slot as one array stacked along dim 0 over the
   pipeline axis (no copy) and merges them into the state of a *stage model*: the same model class with
   `layers_per_stage` layers, whose graph the jitted steps merge inside `shard_map`.
4. For layers under `lax.scan`, `scan_layers` turns that stage model into one period of layers with each
   parameter stacked over the period's repeats (`jaxserve/model/layer_loop.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.loader.tree import ParamPath, flatten, set_path
from jaxserve.model.feature_major import feature_major_linears
from jaxserve.model.layer_loop import layer_period
from jaxserve.model.moe import split_experts as split_expert_stacks
from jaxserve.model.registry import abstract_model
from sharding.loading import Fill, InPlace, array_from_reader, host_buffer, stack_stages
from sharding.mesh import MeshPlan
from sharding.rules import ParamLayout, is_layer_param, runtime_spec


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    path: ParamPath  # ("layers", "3", "self_attn", "q_proj", "kernel")
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
    layer_repeats: int = 1  # > 1: one period of layers, parameters stacked that deep (`scan_layers`)
    feature_major: bool = False  # linear layers turned as a CPU runs them (`feature_major`, loader/turned.py)

    @property
    def shardings(self):
        return jax.tree.map(lambda a: a.sharding, self.params)

    @property
    def specs(self):
        return jax.tree.map(lambda a: a.sharding.spec, self.params)

    @property
    def num_bytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params))


def loading_progress(total: int):
    """The weight-loading progress bar (on stderr)."""
    return tqdm(total=total, desc="Loading weights", unit="tensor")


# Parameters filled at once: copying and transposing tiles release the GIL, so threads overlap them with
# page faults and host-to-device transfers. Each holds one parameter's host buffer at most.
LOADER_THREADS = min(4, os.cpu_count() or 1)


class RegionReader:
    """A checkpoint read region by region: `reader(path, shape)` fills any region of a parameter (NNX layout),
    `in_place(path, dtype)` hands out regions that can become device arrays as they lie (or None)."""
    description = "a checkpoint"  # for the loading log line

    def reader(self, path: ParamPath, shape: tuple[int, ...]) -> Fill:
        raise NotImplementedError

    def in_place(self, path: ParamPath, dtype) -> InPlace | None:
        return None

    def expect(self, shapes: dict[ParamPath, tuple[int, ...]]) -> None:
        """Told every parameter's shape before any is read (for a reader that makes several from one)."""

    def close(self) -> None:
        pass

    def read(self, entries: list[ParamEntry]) -> dict[ParamPath, jax.Array]:
        """Every entry's array on its sharding; the reader is closed afterwards."""
        self.expect({e.path: tuple(e.layout.shape) for e in entries})
        def load(e: ParamEntry) -> jax.Array:
            fill = self.reader(e.path, e.layout.shape)
            return array_from_reader(e.layout.shape, e.layout.padded, e.sharding, e.dtype, fill,
                                     self.in_place(e.path, e.dtype))

        # Biggest first: a big tensor left for the end loads on one thread while the others idle (the 262 MB
        # LM head of a 1B model, last in parameter order, was a second of one thread's work after the rest).
        biggest_first = sorted(entries, key=lambda e: -math.prod(e.layout.padded) * np.dtype(e.dtype).itemsize)
        arrays = {}
        try:
            with ThreadPoolExecutor(LOADER_THREADS) as pool, loading_progress(len(entries)) as bar:
                futures = {pool.submit(load, e): e.path for e in biggest_first}
                try:
                    for done in as_completed(futures):
                        arrays[futures[done]] = done.result()
                        bar.update()
                except BaseException:  # a bad tensor (or ^C) stops the loading now, not after every other
                    pool.shutdown(cancel_futures=True)
                    raise
        finally:
            self.close()
        return arrays


class ModuleReader(RegionReader):
    """Slices of an in-memory module's parameters (the random demo model, tests). Copied: the device
    arrays must not alias the module's."""
    description = "a module in memory"

    def __init__(self, module: nnx.Module):
        self.params = {tuple(str(p) for p in path): value for path, value in
                       flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param)))}

    def reader(self, path: ParamPath, shape: tuple[int, ...]) -> Fill:
        value = np.asarray(self.params[tuple(str(p) for p in path)])
        if value.shape != tuple(shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))} has shape {value.shape}, expected {shape}")
        return lambda index, out: np.copyto(out, value[index], casting="unsafe")

    def close(self) -> None:
        self.params.clear()


def check_stage_pattern(config: ModelConfig, plan: MeshPlan) -> None:
    """Every stage runs one graph, so layer slot j must be the same kind of layer on every stage."""
    for slot in range(plan.layers_per_stage):
        layers = [plan.layer_at(s, slot) for s in range(plan.pp)]
        kinds = {(config.layer_types[i], config.sparse_layers[i]) for i in layers if i is not None}
        if len(kinds) > 1:
            raise ValueError(f"pipeline parallelism over {plan.pp} stages puts layers {layers} in one slot, but "
                             f"they differ in attention kind or MLP: choose a pipeline size whose stages repeat "
                             f"the layer pattern")


def assemble(arrays: dict[ParamPath, jax.Array], config: ModelConfig, dtype, plan: MeshPlan,
             feature_major: bool = False) -> ShardedModel:
    check_stage_pattern(config, plan)
    stage = config.first_layers(plan.layers_per_stage)
    graphdef, state = nnx.split(abstract_model(stage, dtype, feature_major))
    runtime = nnx.to_pure_dict(state)
    for path, _ in list(flatten(runtime)):
        key = tuple(str(p) for p in path)
        if is_layer_param(key):
            slot, rest = int(key[1]), key[2:]
            pieces = []
            for stage_index in range(plan.pp):
                layer = plan.layer_at(stage_index, slot)
                pieces.append(None if layer is None else arrays.pop(("layers", str(layer)) + rest))
            template = next(p for p in pieces if p is not None)
            value = stack_stages(pieces, plan, runtime_spec(key, template.sharding.spec, template.ndim))
        else:
            value = arrays.pop(key)
        set_path(runtime, path, value)
    nnx.replace_by_pure_dict(state, runtime)
    return ShardedModel(plan=plan, config=config, graphdef=graphdef, params=state, dtype=dtype,
                        feature_major=feature_major)


def scan_layers(model: ShardedModel) -> ShardedModel:
    """The stage model for layers under `lax.scan` (`jaxserve/model/layer_loop.py`): one period of layers
    whose parameters are stacked over the period's repeats (`layer_repeats`) on a new leading axis.
    Each group of per-layer arrays is freed as its stack is made, so the copy costs one group's bytes at
    most. A stage whose layers never repeat comes back as it is (repeats 1: unrolled)."""
    stage_config = model.config.first_layers(model.plan.layers_per_stage)
    layers = abstract_model(stage_config, model.dtype).layers
    period = layer_period([nnx.graphdef(layer) for layer in layers])
    repeats = len(layers) // period
    if repeats == 1:
        return model
    template = abstract_model(stage_config.first_layers(period), model.dtype, model.feature_major)
    template.layer_repeats = repeats
    graphdef, state = nnx.split(template)
    current = {tuple(str(p) for p in path): a for path, a in flatten(nnx.to_pure_dict(model.params))}
    model.params = None  # the stacks replace these arrays: drop the model's references to them
    runtime = nnx.to_pure_dict(state)
    for path, _ in list(flatten(runtime)):
        key = tuple(str(p) for p in path)
        if is_layer_param(key):
            first, rest = int(key[1]), key[2:]
            pieces = [current.pop(("layers", str(t * period + first)) + rest) for t in range(repeats)]
            stack = _stacker(pieces[0].sharding)
            value = jax.eval_shape(stack, *pieces) if _abstract(pieces[0]) else stack(*pieces)
            del pieces
        else:
            value = current.pop(key)
        set_path(runtime, path, value)
    nnx.replace_by_pure_dict(state, runtime)
    return dataclasses.replace(model, graphdef=graphdef, params=state, layer_repeats=repeats)


def _abstract(value) -> bool:
    return isinstance(value, jax.ShapeDtypeStruct)


@functools.cache
def _stacker(sharding: NamedSharding):
    """arrays of `sharding` -> one array stacked on a new leading axis, kept whole; one jitted function per
    sharding, so groups of the same shape (q and o projections, gate and up) share its program."""
    return jax.jit(lambda *a: jnp.stack(a), out_shardings=NamedSharding(sharding.mesh, P(None, *sharding.spec)))


def feature_major(model: ShardedModel, weights_in_place: bool = False, experts_apart: bool = False) -> ShardedModel:
    """The model with its linear layers feature-major (`jaxserve/model/feature_major.py`). Single device
    only: under tensor or pipeline parallelism the kernels' partition specs would have to turn with them,
    and a CPU serves from one device. `weights_in_place`: the arrays are views of a mapped checkpoint's file,
    so the ones left as loaded are copied too (below). `experts_apart`: `split_experts` in the same pass, so
    that a mapped file's expert stacks are copied once, into their split, rather than kept and then split."""
    if model.plan.tp * model.plan.pp != 1:
        raise ValueError("feature-major linear layers run on one device (tensor and pipeline parallel size 1)")
    remake = feature_major_linears
    if experts_apart:
        _check_experts_apart(model)
        remake = lambda module: split_expert_stacks(feature_major_linears(module), host_buffer)
    graphdef, params = _remade(model, remake, weights_in_place)
    return dataclasses.replace(model, graphdef=graphdef, params=params, feature_major=True)


def _remade(model: ShardedModel, remake, weights_in_place: bool):
    """`remake` (in place, on the merged module) applied to the model's weights: its graph and arrays.
    `weights_in_place`: the arrays are views of a mapped checkpoint's file, so those left as loaded are
    copied too (below)."""
    loaded = {id(a) for a in jax.tree.leaves(model.params)} if weights_in_place else set()
    module = nnx.merge(model.graphdef, model.params)
    model.params = None  # the module holds the only references now: each array replaced is freed as it goes
    graphdef, params = nnx.split(remake(module))
    if loaded:
        # A mapped file stays mapped (and every page read from it resident, the replaced arrays' too) while
        # any view of it lives: with the embedding and norms copied as well, the model holds only its own memory.
        params = jax.tree.map(lambda a: jnp.array(a, copy=True) if id(a) in loaded else a, params)
    return graphdef, params


def split_experts(model: ShardedModel, weights_in_place: bool = False) -> ShardedModel:
    """The model with each sparse layer's experts held as separate arrays (`SplitExperts` in
    jaxserve/model/moe.py), which a CPU's tile loop reads where they lie instead of copying each tile's expert
    out of its stack. One device and unrolled layers only: partition rules and `scan_layers` name the stacks.
    `weights_in_place`: as for `feature_major`."""
    _check_experts_apart(model)
    graphdef, params = _remade(model, lambda module: split_expert_stacks(module, host_buffer), weights_in_place)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def experts_can_split(model: ShardedModel) -> bool:
    """Whether `split_experts` applies: one device and unrolled layers (partition rules and `scan_layers`
    name the stacks)."""
    return model.plan.tp * model.plan.pp == 1 and model.layer_repeats == 1


def _check_experts_apart(model: ShardedModel) -> None:
    if not experts_can_split(model):
        raise ValueError("split experts run on one device with unrolled layers")
