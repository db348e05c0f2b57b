"""The persistent compilation cache: a restarted server's warm-up loads its programs from disk."""

import json
import os
import shutil
import subprocess
import sys

WARMUP_AND_COUNT_HITS = """
import collections, sys, jax
events = collections.Counter()
jax.monitoring.register_event_listener(lambda event, **_: events.update([event.rsplit('/', 1)[-1]]))
from server.serve import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from jaxserve import Engine, EngineArgs, SamplingParams
engine = Engine(EngineArgs("demo-random", max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, token_buckets=(2, 16)))
engine.warmup()
report = engine.warmup_report
engine.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=8))  # prefill chunks + decodes
tokens = []
while engine.has_unfinished():
    tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
print('tokens', tokens)
print('report', report.programs, report.cache_hits, report.program_cache_hits, engine.compilations_since_warmup,
      sorted(engine.startup_seconds))
print('cache', events['cache_hits'], events['cache_misses'])
"""


def _warmup_cache_use(cache_dir) -> tuple[int, int, str, str]:
    """(hits, misses) of JAX's persistent cache over one process's engine start and warm-up, the engine's
    own report (programs compiled, of those from a cache, of those from the program cache, compilations
    after warm-up, start-up phases) and the tokens it then generated."""
    out = subprocess.run([sys.executable, "-c", WARMUP_AND_COUNT_HITS, str(cache_dir)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    hits, misses = out.stdout.split("cache")[-1].split()
    return (int(hits), int(misses), out.stdout.split("report ")[1].split("\n")[0],
            out.stdout.split("tokens ")[1].split("\n")[0])


PHASES = "['all_programs', 'compile', 'kv_cache', 'total', 'weights']"


def test_restart_compiles_from_cache_and_reports_every_program_as_a_hit(tmp_path):
    _, misses, report, tokens = _warmup_cache_use(tmp_path)
    assert misses > 0 and any(tmp_path.iterdir())  # first start: programs compiled and written
    programs, hits, executables, after, phases = report.split(" ", 4)
    # Warm-up compiled every program ahead of time: a workload that uses several buckets compiles nothing.
    assert int(programs) > 1 and int(hits) == int(executables) == 0 and int(after) == 0 and phases == PHASES
    hits, misses, report, tokens_again = _warmup_cache_use(tmp_path)
    assert misses == 0 and hits > 0  # restart: every program comes from the caches, nothing is compiled
    programs, report_hits, executables, after, _ = report.split(" ", 4)
    # The step programs come from the program cache (not traced at all), and compute what they did.
    assert int(report_hits) == int(executables) == int(programs) and int(after) == 0
    assert tokens_again == tokens and len(json.loads(tokens)[0]) == 8


def test_a_program_from_jax_s_cache_is_not_stored_in_the_program_cache(tmp_path):
    """A code edit that leaves the programs alike: JAX's cache has them, the program cache (keyed by the code)
    does not. An executable JAX loaded from its cache does not serialize whole on XLA:CPU (its copy loads,
    then fails at the first step), so it must not go into the program cache: every later start takes them
    from JAX's cache, and generates what the first did."""
    *_, tokens = _warmup_cache_use(tmp_path)
    shutil.rmtree(tmp_path / "jaxserve-programs")  # as after an edit: this code's programs are not there
    for _ in range(2):
        _, misses, report, tokens_again = _warmup_cache_use(tmp_path)
        programs, hits, executables, after, _ = report.split(" ", 4)
        assert misses == 0 and int(hits) == int(programs) and int(executables) == 0 and int(after) == 0
        assert tokens_again == tokens
