"""Run by tests/test_sharded_loading_memory.py in a fresh process: load a model directory on a mesh
(tp x pp over fake CPU devices) while a thread samples this process's resident memory, and print one
JSON line with the numbers.

Two measures, each as a peak above the baseline: RssAnon (anonymous memory: buffers the loader
allocates) and VmRSS (also the checkpoint's memory-mapped pages this process has touched and not yet
dropped). On fake CPU devices the "device" buffers are host memory too, so the host memory the load
*added* is: peak - baseline - bytes of the loaded shards.
"""

import json
import sys
import threading
import time


def memory() -> tuple[int, int]:
    """(RssAnon, VmRSS) in bytes, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["RssAnon"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def main(model_dir: str, tp: int, pp: int) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.loader.load import load_sharded
    from sharding import ParallelConfig, make_plan

    assert jax.device_count() >= tp * pp, jax.devices()
    config = ModelConfig.from_pretrained(model_dir)
    plan = make_plan(ParallelConfig(tp, pp), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    jnp.zeros(1).block_until_ready()  # backend and allocator up before the baseline
    baseline = memory()
    peak, stop = list(baseline), threading.Event()

    def sample():
        while not stop.is_set():
            peak[:] = map(max, peak, memory())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    model = load_sharded(model_dir, config, jnp.float32, plan)
    jax.block_until_ready(model.params)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    peak[:] = map(max, peak, memory())
    shard_bytes = sum(s.data.nbytes for leaf in jax.tree.leaves(model.params) for s in leaf.addressable_shards)
    print(json.dumps({"baseline": baseline[0], "peak": peak[0], "baseline_rss": baseline[1], "peak_rss": peak[1],
                      "shard_bytes": shard_bytes, "seconds": seconds, "model_bytes": model.num_bytes}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
