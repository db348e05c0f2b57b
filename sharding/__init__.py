"""Sharding over a device mesh: tensor and pipeline parallelism, sharded loading, multi-host start.

`mesh` builds the mesh once at start, `rules` is the table of partition specs for parameters and the KV
cache, `loading` builds sharded arrays shard by shard, `pipeline` is the microbatched stage schedule run
inside the jitted steps, and `multihost` joins `jax.distributed` and hands each step from process 0 to
the others. Nothing here knows about HTTP or requests.
"""

import importlib

__all__ = ["PIPELINE", "TENSOR", "KV_REPLICA", "TP_AXES", "MeshPlan", "ParallelConfig", "make_plan"]


def __getattr__(name: str):
    # The mesh names are read from `sharding.mesh` on first use, not at package import: `sharding.chips` is
    # plain data the CLI's parser reads (`jaxserve plan --help`, `bench serve`), and importing the mesh
    # would load JAX into processes that only talk HTTP.
    if name in __all__:
        return getattr(importlib.import_module("sharding.mesh"), name)
    raise AttributeError(f"module 'sharding' has no attribute {name!r}")
