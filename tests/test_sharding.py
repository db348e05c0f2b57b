"""Sharding: partition rules and mesh planning (here, one device). The 8-device tests (tensor / pipeline
parity, Orbax re-sharding) run in processes of their own: tests/test_eight_devices.py."""

from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from sharding import ParallelConfig, make_plan
from sharding.rules import kv_cache_spec, param_layout, runtime_spec

ROOT = Path(__file__).resolve().parents[1]


MESH = {"pipeline": 2, "tensor": 4, "kv_replica": 2}  # tp 8 over a model with 4 KV heads


def test_rules_split_heads_mlp_vocab_and_replicate_kv_heads():
    tp = ("tensor", "kv_replica")
    assert param_layout(("layers", "0", "self_attn", "q_proj", "kernel"), (64, 64), MESH).spec == P(None, tp)
    assert param_layout(("layers", "0", "self_attn", "o_proj", "kernel"), (64, 64), MESH).spec == P(tp, None)
    # KV heads over `tensor` only: the 2 devices of a kv_replica pair hold the same head.
    assert param_layout(("layers", "0", "self_attn", "k_proj", "kernel"), (64, 32), MESH).spec == P(None, "tensor")
    assert param_layout(("layers", "0", "self_attn", "o_proj", "bias"), (64,), MESH).spec == P(None)
    embed = param_layout(("embed_tokens", "embedding"), (500, 64), MESH)
    assert embed.spec == P(tp, None) and embed.padded == (504, 64)  # vocab padded to a multiple of 8
    mlp = param_layout(("layers", "3", "mlp", "down_proj", "kernel"), (172, 64), MESH)
    assert mlp.padded == (176, 64) and mlp.spec == P(tp, None)
    unpadded = param_layout(("layers", "3", "mlp", "down_proj", "kernel"), (172, 64), MESH, pad=False)
    assert unpadded.padded == (172, 64) and unpadded.spec == P(None, None)
    assert runtime_spec(("layers", "0", "mlp", "down_proj", "kernel"), mlp.spec, 2) == \
        P(("pipeline", "tensor", "kv_replica"), None)
    assert runtime_spec(("layers", "0", "input_layernorm", "weight"), P(None), 1) == P(("pipeline",))
    assert runtime_spec(("norm", "weight"), P(None), 1) == P(None)
    assert kv_cache_spec() == P(("pipeline", "tensor"), None, None, None)


def test_experts_split_their_mlp_or_with_expert_parallelism_their_experts():
    tp = ("tensor", "kv_replica")
    gate = ("layers", "0", "mlp", "experts", "gate_proj")
    down = ("layers", "1", "block_sparse_moe", "experts", "w2")
    assert param_layout(gate, (64, 32, 20), MESH).spec == P(None, None, tp)
    assert param_layout(gate, (64, 32, 20), MESH).padded == (64, 32, 24)  # zero columns: act(0) * 0 = 0
    assert param_layout(down, (64, 20, 32), MESH).spec == P(None, tp, None)
    assert param_layout(gate, (64, 32, 20), MESH, expert_parallel=True).spec == P(tp, None, None)
    assert param_layout(down, (64, 20, 32), MESH, expert_parallel=True).spec == P(tp, None, None)
    assert param_layout(("layers", "0", "mlp", "gate", "kernel"), (32, 64), MESH).spec == P(None, None)  # router
    with pytest.raises(ValueError, match="does not split 8 ways"):  # experts are never padded
        param_layout(gate, (60, 32, 20), MESH, expert_parallel=True)


def test_heads_must_divide():
    with pytest.raises(ValueError, match="qkv|q_proj|does not split"):
        param_layout(("layers", "0", "self_attn", "q_proj", "kernel"), (64, 60), MESH)


@pytest.mark.parametrize("tp, pp, match", [
    (3, 1, "must divide the model's 8 attention heads"),
    (8, 1, "multiple of them"),  # 6 KV heads
    (1, 9, "exceeds the model's 5 layers"),
    (2, 1, "needs 2 devices"),  # this process has one
])
def test_plan_errors_name_the_problem(tp, pp, match):
    kv = 6 if (tp, pp) == (8, 1) else 4
    with pytest.raises(ValueError, match=match):
        make_plan(ParallelConfig(tp, pp), num_layers=5, num_heads=24 if kv == 6 else 8, num_kv_heads=kv)


def test_one_device_plan_and_bad_sizes():
    plan = make_plan(ParallelConfig(), num_layers=5, num_heads=8, num_kv_heads=4)
    assert dict(plan.mesh.shape) == {"pipeline": 1, "tensor": 1, "kv_replica": 1}
    assert plan.mesh.devices.flat[0] == jax.devices()[0] and plan.layers_per_stage == 5
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)


def test_docs_name_real_flags_and_process_0_serving():
    import argparse

    from jaxserve.entrypoints.args import add_engine_args

    doc = (ROOT / "docs" / "sharding.md").read_text()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    known = {o for a in parser._actions for o in a.option_strings}
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--distributed-coordinator",
                 "--num-processes", "--process-id"):
        assert flag in doc and flag in known
    for topic in ("TPU", "GPU", "Process 0", "broadcast_one_to_all", "jaxserve convert"):
        assert topic in doc
