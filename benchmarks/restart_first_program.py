"""A restart's first step program: loaded from the program cache against found through JAX's persistent
cache (trace, lower, then load), in fresh processes, alternating, same run.

Each round starts two processes on caches that already hold the program: one with the program cache's
entries hidden (so the step is traced and lowered and JAX's cache supplies the executable) and one with
them in place. Each builds the engine on the model, then times getting the first program (the one a
server needs before it reports ready). The default model is the mapped random 1.1B Llama that
`benchmarks/cold_start.py` builds.

    ./dev run python benchmarks/restart_first_program.py [--model DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache" / "jaxserve-peers" / "models" / "llama1b-random-mapped"

FIRST_PROGRAM = """
import sys, time
from server.serve import enable_compilation_cache
enable_compilation_cache(sys.argv[1])
from jaxserve import Engine, EngineArgs
from jaxserve.execution.program_cache import ProgramCache
engine = Engine(EngineArgs(model=sys.argv[2], max_num_seqs=16, max_model_len=1024))
runner = engine.runner
runner.programs = ProgramCache.beside_jax_cache()
start = time.perf_counter()
runner._load_or_compile(runner.layouts[runner.compile_order()[0]])
print("seconds", time.perf_counter() - start)
"""


def first_program_seconds(cache: Path, model: Path) -> float:
    out = subprocess.run([sys.executable, "-c", FIRST_PROGRAM, str(cache), str(model)], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1],
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    return float(out.stdout.split("seconds")[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart-first-program-") as tmp:
        cache = Path(tmp) / "xla"
        programs, hidden = cache / "jaxserve-programs", Path(tmp) / "hidden-programs"
        print(f"first start (fills both caches): {first_program_seconds(cache, args.model):.2f}s", flush=True)
        shutil.copytree(programs, hidden)
        traced, loaded = [], []
        for round_ in range(args.rounds):
            for use_program_cache in ((False, True) if round_ % 2 == 0 else (True, False)):
                shutil.rmtree(programs)
                if use_program_cache:
                    shutil.copytree(hidden, programs)
                else:  # the traced run stores the program again: the next round starts from `hidden` anew
                    programs.mkdir()
                seconds = first_program_seconds(cache, args.model)
                (loaded if use_program_cache else traced).append(seconds)
                print(f"round {round_ + 1}: {'program cache' if use_program_cache else 'JAX cache (traced)'}"
                      f" {seconds:.2f}s", flush=True)
    ratios = [a / b for a, b in zip(loaded, traced)]
    print("\n| first program on a restart | median s | rounds |\n|---|---:|---:|")
    print(f"| traced, lowered, from JAX's persistent cache | {statistics.median(traced):.2f} | {len(traced)} |")
    print(f"| from the program cache | {statistics.median(loaded):.2f} | {len(loaded)} |")
    print(f"\nprogram cache / JAX cache, paired: {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(geometric mean {statistics.geometric_mean(ratios):.2f})")
    print(f"reproduce: ./dev run python benchmarks/restart_first_program.py --model {args.model} --rounds {args.rounds}")


if __name__ == "__main__":
    main()
