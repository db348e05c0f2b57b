"""Compile time of every step program against model depth, unrolled layers against layers under `lax.scan`.

1. For each depth (default 4, 16 and 32 layers of the same width: the 124.7M model's hidden 768, 12
   heads, 3072 intermediate, vocabulary 32000) and each `--layer-loop` (unroll, scan), a fresh process
   builds a random Llama and an engine with the server's default token buckets (every power of two up to
   the 512-token CPU budget), and times warm-up: every step program compiled, none loaded (no JAX or
   program cache: a first start).
2. The same process then times batch-1 decode: one request, 48 greedy tokens after a 16-token prompt,
   the median gap between tokens, so the runtime price of each layer loop sits beside its compile time.
3. Prints a table, the deepest over the shallowest compile time per loop (issue 28's target: the 32-layer
   model at most 1.5x the 4-layer one), and the command that reproduces the run.

Run: ./dev run python benchmarks/compile_depth.py  (--depths 4,16,32 --loops unroll,scan)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", default="4,16,32")
    p.add_argument("--loops", default="unroll,scan")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--one", nargs=2, metavar=("LAYERS", "LOOP"), help=argparse.SUPPRESS)  # a child run
    return p.parse_args(argv)


def one_run(a: argparse.Namespace, layers: int, loop: str) -> dict:
    import jax.numpy as jnp

    from jaxserve import Engine, EngineArgs, SamplingParams
    from jaxserve.config import ModelConfig
    from jaxserve.engine.builder import build_from_module
    from jaxserve.model.registry import random_model
    from jaxserve.text.tokenizer import Tokenizer

    config = ModelConfig(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden,
                         intermediate_size=a.intermediate, num_layers=layers, num_heads=a.heads,
                         num_kv_heads=a.heads, head_dim=a.hidden // a.heads, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    args = EngineArgs(max_num_seqs=16, max_model_len=256, layer_loop=loop)
    built = build_from_module(args, "random-llama", random_model(config, jnp.float32), config,
                              Tokenizer.byte_level(), jnp.float32)
    engine = Engine(args, built=built)
    engine.warmup()
    report = engine.warmup_report
    assert report.cache_hits == 0 and report.program_cache_hits == 0, report
    request = engine.add_request(list(range(3, 19)), SamplingParams(temperature=0, max_tokens=a.decode_tokens,
                                                                    ignore_eos=True))
    arrivals = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request and out.new_token_ids:
                arrivals.append(time.perf_counter())
    gaps = [b - x for x, b in zip(arrivals[1:], arrivals[2:])]
    assert engine.compilations_since_warmup == 0
    return dict(layers=layers, loop=loop, programs=report.programs, compile_s=report.seconds,
                itl_ms=statistics.median(gaps) * 1e3)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.one:
        print(json.dumps(one_run(a, int(a.one[0]), a.one[1])))
        return 0
    depths = [int(d) for d in a.depths.split(",")]
    loops = a.loops.split(",")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    rows = []
    for layers in depths:
        for loop in loops:  # alternating loops per depth: machine drift hits both alike
            out = subprocess.run([sys.executable, __file__, *argv, "--one", str(layers), loop], env=env,
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{layers} layers, {loop}: {row['programs']} programs in {row['compile_s']:.1f} s, "
                  f"decode {row['itl_ms']:.1f} ms a token", flush=True)
    print()
    print(f"Compile time of all step programs by depth (hidden {a.hidden}, float32, first start; "
          f"{os.cpu_count()} CPUs, {platform.machine()}):")
    print()
    print("| layers | " + " | ".join(f"{loop}: compile s | {loop}: batch-1 ms/token" for loop in loops) + " |")
    print("|---:|" + "---:|---:|" * len(loops))
    by = {(r["layers"], r["loop"]): r for r in rows}
    for layers in depths:
        cells = [f"{by[layers, loop]['compile_s']:.1f} | {by[layers, loop]['itl_ms']:.1f}" for loop in loops]
        print(f"| {layers} | " + " | ".join(cells) + " |")
    print()
    for loop in loops:
        deep, shallow = by[depths[-1], loop]["compile_s"], by[depths[0], loop]["compile_s"]
        print(f"{loop}: {depths[-1]} layers / {depths[0]} layers compile time = {deep / shallow:.2f}x")
    print("Reproduce: ./dev run python " + shlex.join(["benchmarks/compile_depth.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
