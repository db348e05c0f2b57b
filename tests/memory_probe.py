"""Run by tests/test_sharded_loading_memory.py in a fresh process with 8 fake CPU devices: load a model
directory sharded tp 4 x pp 2 while a thread samples this process's anonymous resident memory, and
print one JSON line with the numbers.

RssAnon (from /proc/self/status) leaves out the checkpoint's page cache (safetensors files are
memory-mapped). On fake CPU devices the "device" buffers are host memory too, so the host memory the
load *added* is: peak RssAnon - baseline - bytes of the loaded shards.
"""

import json
import sys
import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(model_dir: str) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.sharded_model import load_sharded
    from sharding import ParallelConfig, make_plan

    assert jax.device_count() == 8, jax.devices()
    config = ModelConfig.from_pretrained(model_dir)
    plan = make_plan(ParallelConfig(4, 2), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    jnp.zeros(1).block_until_ready()  # backend and allocator up before the baseline
    baseline = rss_anon()
    peak, stop = [baseline], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = load_sharded(model_dir, config, jnp.float32, plan)
    jax.block_until_ready(model.params)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    shard_bytes = sum(s.data.nbytes for leaf in jax.tree.leaves(model.params) for s in leaf.addressable_shards)
    print(json.dumps({"baseline": baseline, "peak": peak[0], "shard_bytes": shard_bytes, "seconds": seconds,
                      "model_bytes": model.num_bytes}))


if __name__ == "__main__":
    main(sys.argv[1])
