"""Loading a ~100M-parameter Llama never holds the model (or anything close) in host memory beyond its
own loaded shards: each device's slice is copied from the memory-mapped safetensors into the buffer that
becomes its device array, a few parameters at a time, and each tensor's mapped pages are dropped after it
is read. Checked on one device and sharded tp 4 x pp 2 over 8 fake devices, against a host-memory budget
smaller than the checkpoint.

The checkpoint is written here one tensor at a time (a file per layer, with an index), so the writer
never holds it either; a fresh process (tests/memory_probe.py) loads it and measures.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
          "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12, "num_key_value_heads": 4,
          "head_dim": 64, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "torch_dtype": "float32"}


def _write_random_llama(model_dir: Path) -> tuple[int, int]:
    """HF-layout float32 safetensors, one file per layer; returns (total bytes, largest tensor bytes)."""
    c = CONFIG
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    q = c["num_attention_heads"] * c["head_dim"]
    rng = np.random.default_rng(0)
    weight_map, total, largest = {}, 0, 0

    def write(file: str, shapes: dict[str, tuple[int, ...]]) -> None:
        nonlocal total, largest
        tensors = {name: (rng.standard_normal(shape, dtype=np.float32) * 0.02) for name, shape in shapes.items()}
        save_file(tensors, model_dir / file)
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.nbytes
            largest = max(largest, t.nbytes)

    write("embed.safetensors", {"model.embed_tokens.weight": (c["vocab_size"], h)})
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        write(f"layer{layer}.safetensors", {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    write("head.safetensors", {"model.norm.weight": (h,), "lm_head.weight": (c["vocab_size"], h)})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    return total, largest


def _probe(model_dir: Path, tp: int, pp: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    result = subprocess.run([sys.executable, "-m", "tests.memory_probe", str(model_dir), str(tp), str(pp)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("llama100m")
    total, largest = _write_random_llama(model_dir)
    assert 95e6 < total / 4 < 110e6  # ~100M float32 parameters (~400 MB)
    return model_dir, total, largest


HOST_BUDGET = 256e6  # bytes of host memory loading may add beyond the model itself: less than the checkpoint


@pytest.mark.parametrize("tp, pp", [(1, 1), (4, 2)])
def test_loading_a_checkpoint_bigger_than_the_host_budget_stays_within_it(random_llama, tp, pp):
    """Resident memory (anonymous buffers and mapped checkpoint pages alike) never grows by more than the
    loaded shards plus the budget, though the checkpoint alone is bigger than the budget."""
    model_dir, total, largest = random_llama
    assert total > HOST_BUDGET
    m = _probe(model_dir, tp, pp)
    assert m["model_bytes"] >= total
    added = m["peak_rss"] - m["baseline_rss"] - m["shard_bytes"]
    print(f"\ntp {tp} pp {pp}: checkpoint {total / 1e6:.0f} MB, shards {m['shard_bytes'] / 1e6:.0f} MB, "
          f"resident memory added beyond the shards {added / 1e6:.0f} MB (budget {HOST_BUDGET / 1e6:.0f} MB), "
          f"{m['seconds']:.1f}s")
    # A loader that kept the checkpoint mapped, or read it whole first, would add ~its size (410 MB) here.
    assert added < HOST_BUDGET, m


def test_peak_host_memory_while_loading_100m_params_sharded(random_llama):
    model_dir, total, largest = random_llama
    m = _probe(model_dir, 4, 2)
    assert m["model_bytes"] >= total  # everything was loaded (plus padding/replicated norms)
    added = m["peak"] - m["baseline"] - m["shard_bytes"]  # host memory beyond the device shards
    print(f"\nmodel {total / 1e6:.0f} MB, largest tensor {largest / 1e6:.0f} MB, device shards "
          f"{m['shard_bytes'] / 1e6:.0f} MB, peak RSS above baseline {(m['peak'] - m['baseline']) / 1e6:.0f} MB, "
          f"host memory added by loading {added / 1e6:.0f} MB, {m['seconds']:.1f}s")
    # A loader that read the whole model to host first would add ~the model size (400 MB) here.
    assert added < total / 4, m
    assert added < 1.5 * largest, m
