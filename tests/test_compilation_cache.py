"""The persistent compilation cache: a restarted server's warm-up loads its programs from disk."""

import os
import subprocess
import sys

WARMUP_AND_COUNT_HITS = """
import collections, sys, jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event.rsplit('/', 1)[-1]]))
from server.serve import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from jaxserve import Engine, EngineArgs
Engine(EngineArgs(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16)).warmup()
print('cache', events['cache_hits'], events['cache_misses'])
"""


def _warmup_cache_use(cache_dir) -> tuple[int, int]:
    """(hits, misses) of the persistent cache over one process's engine start and warm-up."""
    out = subprocess.run([sys.executable, "-c", WARMUP_AND_COUNT_HITS, str(cache_dir)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    hits, misses = out.stdout.split("cache")[-1].split()
    return int(hits), int(misses)


def test_restart_compiles_from_cache(tmp_path):
    _, misses = _warmup_cache_use(tmp_path)
    assert misses > 0 and any(tmp_path.iterdir())  # first start: programs compiled and written
    hits, misses = _warmup_cache_use(tmp_path)
    assert misses == 0 and hits > 0  # restart: every program comes from the cache
