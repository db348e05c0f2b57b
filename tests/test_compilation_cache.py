"""The persistent compilation cache: a restarted server's warm-up loads its programs from disk."""

import os
import subprocess
import sys

WARMUP_AND_COUNT_HITS = """
import sys, jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event == '/jax/compilation_cache/cache_hits' else None)
from server.app import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from jaxserve import Engine, EngineArgs
Engine(EngineArgs(max_num_seqs=2, max_model_len=64, prefill_buckets=(16,))).warmup()
print('cache hits', len(hits))
"""


def _warmup_hits(cache_dir) -> int:
    out = subprocess.run([sys.executable, "-c", WARMUP_AND_COUNT_HITS, str(cache_dir)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split("cache hits")[-1])


def test_restart_compiles_from_cache(tmp_path):
    assert _warmup_hits(tmp_path) == 0  # first start: everything compiled and written
    assert any(tmp_path.iterdir())
    assert _warmup_hits(tmp_path) > 0  # restart: the programs come from the cache
