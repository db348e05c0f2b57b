"""Loading, one straight path: a checkpoint's reader -> parameters placed on the device mesh.

1. Read: `open_checkpoint` detects a directory's format and opens its reader (`formats.py`): Hugging Face
   safetensors, a mapped checkpoint used in place, or Orbax. An in-memory module (the demo model,
   benchmarks) is read by a `ModuleReader`.
2. Plan: `param_entries` gives every parameter its layout from the partition rules (`placement.py`).
3. Fill and place: the reader fills each entry, every device reading only its own slice, and `assemble`
   stacks the pipeline stages' layers into the model state the jitted step runs on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.loader.formats import open_checkpoint
from jaxserve.loader.placement import ModuleReader, ShardedModel, assemble, param_entries
from jaxserve.loader.quantized import checkpoint_quantization, quantized_loading, stored_quantization
from jaxserve.loader.turned import UnturningReader, stored_turned
from sharding import ParallelConfig, make_plan
from sharding.mesh import MeshPlan

logger = logging.getLogger(__name__)


def load_weights(reader, config: ModelConfig, dtype, plan: MeshPlan, feature_major: bool = False) -> ShardedModel:
    """Every parameter `reader` holds, placed on the mesh of `plan`; `feature_major`: the reader holds the
    linear layers turned (`turned.py`), and the model is built so."""
    start = time.perf_counter()
    entries = param_entries(config, dtype, plan, feature_major=feature_major)
    model = assemble(reader.read(entries), config, dtype, plan, feature_major)
    seconds = time.perf_counter() - start
    logger.info("weights: %d tensors, %.1f MB on the mesh, from %s as %s in %.1fs (%.2f GB/s)", len(entries),
                model.num_bytes / 1e6, reader.description, jnp.dtype(dtype).name, seconds,
                model.num_bytes / 1e9 / max(seconds, 1e-9))
    return model


def load_sharded(model_dir: str | Path, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """Any supported checkpoint directory onto the mesh of `plan`, each device reading its shards; quantized
    linear layers as the checkpoint stores them (the returned model's config says how), in the model's own
    layout (a feature-major mapped checkpoint's layers turned back: `turned.py`)."""
    reader, config = quantized_loading(open_checkpoint(model_dir), config, None, checkpoint_quantization(model_dir),
                                       stored=stored_quantization(model_dir))
    if stored_turned(model_dir):
        reader = UnturningReader(reader, config, dtype)
    return load_weights(reader, config, dtype, plan)


def shard_module(module: nnx.Module, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """An in-memory (unsharded) module onto the mesh: the demo model, tests."""
    return load_weights(ModuleReader(module), config, dtype, plan)


def load_model(model_dir: str | Path, config: ModelConfig, dtype) -> nnx.Module:
    """The whole model on one device, as a plain module: for notebooks and single-device tools."""
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(model_dir, config, dtype, plan)
    return nnx.merge(model.graphdef, model.params)


def abstract_weights(config: ModelConfig, dtype, plan: MeshPlan, feature_major: bool = False) -> ShardedModel:
    """The model as `load_weights` places it, with `jax.ShapeDtypeStruct`s (shape, dtype, sharding) where the
    arrays would be: what compiling a step needs of the weights (`jaxserve plan`). Nothing is read or
    allocated, so it works for a mesh of compile-only devices and a model of any size."""
    entries = param_entries(config, dtype, plan, feature_major=feature_major)
    shapes = {e.path: jax.ShapeDtypeStruct(e.layout.padded, e.dtype, sharding=e.sharding) for e in entries}
    return assemble(shapes, config, dtype, plan, feature_major)
