"""Sharding over a device mesh: tensor and pipeline parallelism, sharded loading, multi-host start.

`mesh` builds the mesh once at start, `rules` is the table of partition specs for parameters and the KV
cache, `loading` builds sharded arrays shard by shard, `pipeline` is the microbatched stage schedule run
inside the jitted steps, and `multihost` joins `jax.distributed` and hands each step from process 0 to
the others. Nothing here knows about HTTP or requests.
"""

from sharding.mesh import KV_REPLICA, PIPELINE, TENSOR, TP_AXES, MeshPlan, ParallelConfig, make_plan

__all__ = ["PIPELINE", "TENSOR", "KV_REPLICA", "TP_AXES", "MeshPlan", "ParallelConfig", "make_plan"]
