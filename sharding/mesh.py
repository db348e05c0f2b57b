"""The device mesh: created once at start, used by every jitted step.

1. `ParallelConfig` holds what the user asks for: `--tensor-parallel-size` and `--pipeline-parallel-size`.
2. `make_plan` resolves it against the model and the devices into a `MeshPlan`. The mesh has three named
   axes, outermost first: `pipeline` (stages), `tensor` and `kv_replica`. A tensor-parallel group is
   `tensor x kv_replica` (tp devices). `kv_replica` is 1 unless tp exceeds the model's KV heads; then
   it is tp // num_kv_heads, so the devices that need the same KV head sit side by side and share a
   `tensor` coordinate: sharding KV weights and the KV cache over `tensor` alone replicates each head
   exactly where its query heads live, with no extra code.
3. Pipeline is outermost so that, across hosts, stages land on different hosts and every tensor
   group stays inside one host's fast interconnect (tensor parallelism all-reduces twice per layer;
   pipeline stages exchange one activation per microbatch).
4. Layers go to stages in contiguous blocks of ceil(num_layers / pp). When that does not divide, the
   last stage's tail slots hold padding layers with zero weights, which are exact identities
   (x + 0 + 0), so every stage runs the same program shape.

No data axis: a serving engine gains data parallelism by running independent replicas behind a load
balancer, which needs no collectives; a data axis inside one engine would either replicate the KV
cache or split the page pool, for no gain in this design.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

logger = logging.getLogger(__name__)

PIPELINE = "pipeline"
TENSOR = "tensor"
KV_REPLICA = "kv_replica"
TP_AXES = (TENSOR, KV_REPLICA)  # the tensor-parallel group: collectives over both


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixtures of experts: whole experts on each tensor-parallel device instead of a slice of every one.
    enable_expert_parallel: bool = False

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    mesh: Mesh  # axes (pipeline, tensor, kv_replica)
    tp: int
    pp: int
    kv_replicas: int
    num_layers: int  # of the model
    layers_per_stage: int
    expert_parallel: bool = False  # experts split over the tensor group (see rules.EXPERT_PARALLEL_AXES)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def stage_mesh(self, stage: int) -> Mesh:
        """The devices of one pipeline stage, as a mesh over the tensor axes (where its layers live)."""
        return Mesh(self.mesh.devices[stage], TP_AXES)

    def layer_at(self, stage: int, slot: int) -> int | None:
        """The model layer in `slot` of `stage`, or None for a padding slot."""
        layer = stage * self.layers_per_stage + slot
        return layer if layer < self.num_layers else None

    @property
    def process_count(self) -> int:
        return jax.process_count()

    def describe(self) -> str:
        kv = f", KV heads replicated x{self.kv_replicas}" if self.kv_replicas > 1 else ""
        pad = self.pp * self.layers_per_stage - self.num_layers
        stages = f", {self.layers_per_stage} layers per stage" + (f" ({pad} padding)" if pad else "")
        return (f"mesh {dict(self.mesh.shape)} on {self.mesh.devices.size} {self.mesh.devices.flat[0].platform} "
                f"device(s): tensor parallel {self.tp}{kv}, pipeline parallel {self.pp}"
                + (stages if self.pp > 1 else "") + (", expert parallel" if self.expert_parallel else ""))


def make_plan(parallel: ParallelConfig, *, num_layers: int, num_heads: int, num_kv_heads: int,
              devices: Sequence[jax.Device] | None = None) -> MeshPlan:
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {num_heads} attention heads")
    if tp <= num_kv_heads and num_kv_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {num_kv_heads} KV heads "
                         f"(or be a multiple of them)")
    if tp > num_kv_heads and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {num_kv_heads} KV heads and must then "
                         f"be a multiple of them, so each KV head is replicated a whole number of times")
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers")
    devices = list(devices if devices is not None else jax.devices())
    n = tp * pp
    if n > len(devices):
        raise ValueError(f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs {n} devices, "
                         f"but {len(devices)} are visible")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"multi-host runs use every device: tensor_parallel_size x pipeline_parallel_size "
                         f"must be {len(devices)}, got {n}")
    if n < len(devices):
        logger.info("using %d of %d devices", n, len(devices))
    grid = _device_grid(devices[:n], pp, tp)
    kv_replicas = tp // num_kv_heads if tp > num_kv_heads else 1
    mesh = Mesh(grid.reshape(pp, tp // kv_replicas, kv_replicas), (PIPELINE, TENSOR, KV_REPLICA))
    return MeshPlan(mesh=mesh, tp=tp, pp=pp, kv_replicas=kv_replicas, num_layers=num_layers,
                    layers_per_stage=-(-num_layers // pp), expert_parallel=parallel.enable_expert_parallel)


def _device_grid(devices: list, pp: int, tp: int) -> np.ndarray:
    """[pp, tp] devices; on TPU/GPU in an order that follows the physical interconnect."""
    try:
        from jax.experimental import mesh_utils
        return np.asarray(mesh_utils.create_device_mesh((pp, tp), devices=devices))
    except Exception:  # noqa: BLE001 - a subset of a slice has no topology-aware layout: plain order
        return np.asarray(devices, dtype=object).reshape(pp, tp)
