"""Loading, one straight path: a checkpoint's description -> its reader -> parameters placed on the device mesh.

1. Describe: `Checkpoint.read` reads what a directory holds, once (`formats.py`): Hugging Face
   safetensors, a mapped checkpoint used in place, or Orbax; how its linear layers are stored. Weights
   in memory (the demo model, benchmarks) are described by `Checkpoint.in_memory`.
2. Plan: the abstract model (`abstract.py`) gives every parameter its shape, dtype and layout on the mesh,
   its linear layers as the config's quantization and the chosen layout make them.
3. Fill and place: the reader the description composes for that model (`Checkpoint.reader`) fills each
   entry, every device reading only its own slice, and `AbstractModel.place` stacks the pipeline stages'
   layers into the model state the jitted step runs on.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.formats import Checkpoint
from jaxserve.loader.placement import ShardedModel
from jaxserve.loader.quantized import QuantizationFlags
from sharding import ParallelConfig, make_plan
from sharding.mesh import MeshPlan

logger = logging.getLogger(__name__)


def load_weights(reader, model: AbstractModel) -> ShardedModel:
    """Every parameter of `model`, filled by `reader` and placed on the mesh of `model.plan`."""
    start = time.perf_counter()
    placed = model.place(reader.read(model.entries))
    seconds = time.perf_counter() - start
    logger.info("weights: %d tensors, %.1f MB on the mesh, from %s as %s in %.1fs (%.2f GB/s)", len(model.entries),
                placed.num_bytes / 1e6, reader.description, jnp.dtype(model.dtype).name, seconds,
                placed.num_bytes / 1e9 / max(seconds, 1e-9))
    return placed


def load_checkpoint(checkpoint: Checkpoint, model: AbstractModel) -> ShardedModel:
    """`model` filled from `checkpoint` (the reader its description composes for it)."""
    return load_weights(checkpoint.reader(model), model)


def load_sharded(model_dir: str | Path, config: ModelConfig, dtype, plan: MeshPlan) -> ShardedModel:
    """Any supported checkpoint directory onto the mesh of `plan`, each device reading its shards; quantized
    linear layers as the checkpoint stores them (the returned model's config says how), in the model's own
    layout (a feature-major mapped checkpoint's layers turned back: `turned.py`)."""
    checkpoint = Checkpoint.read(model_dir)
    config = checkpoint.served_config(config, QuantizationFlags())
    return load_checkpoint(checkpoint, AbstractModel(config, dtype, plan))


def load_model(model_dir: str | Path, config: ModelConfig, dtype) -> nnx.Module:
    """The whole model on one device, as a plain module: for notebooks and single-device tools."""
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(model_dir, config, dtype, plan)
    return nnx.merge(model.graphdef, model.params)
