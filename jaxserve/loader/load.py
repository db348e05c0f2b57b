"""Loading, one straight path: checkpoint directory -> parameters placed on the device mesh.

1. Plan: `param_entries` gives every parameter its layout from the partition rules (`placement.py`).
2. Read: `open_checkpoint` detects the directory's format and opens its reader (`formats.py`): Hugging
   Face safetensors, a mapped checkpoint used in place, or Orbax; the reader fills each entry, every
   device reading only its own slice.
3. Place: `assemble` stacks the pipeline stages' layers and gives the model state the jitted step runs on.
An in-memory module (the demo model, benchmarks) takes the same path with a `ModuleReader`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.loader.formats import describe_reader, open_checkpoint
from jaxserve.loader.placement import ModuleReader, ShardedModel, assemble, param_entries
from sharding import ParallelConfig, make_plan
from sharding.mesh import MeshPlan

logger = logging.getLogger(__name__)


def load_sharded(model_dir: str | Path, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """Any supported checkpoint directory onto the mesh of `plan`, each device reading its shards."""
    start = time.perf_counter()
    entries = param_entries(config, dtype, plan)
    reader = open_checkpoint(model_dir)
    model = assemble(reader.read(entries), config, dtype, plan)
    seconds = time.perf_counter() - start
    logger.info("weights: %d tensors, %.1f MB on the mesh, from %s (%s) as %s in %.1fs (%.2f GB/s)", len(entries),
                model.num_bytes / 1e6, model_dir, describe_reader(reader), jnp.dtype(dtype).name, seconds,
                model.num_bytes / 1e9 / max(seconds, 1e-9))
    return model


def shard_module(module: nnx.Module, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """An in-memory (unsharded) module onto the mesh: the demo model, tests."""
    return assemble(ModuleReader(module).read(param_entries(config, dtype, plan)), config, dtype, plan)


def load_model(model_dir: str | Path, config: ModelConfig, dtype) -> nnx.Module:
    """The whole model on one device, as a plain module: for notebooks and single-device tools."""
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(model_dir, config, dtype, plan)
    return nnx.merge(model.graphdef, model.params)
