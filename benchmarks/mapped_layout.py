"""A mapped checkpoint stored feature-major against one in the model's own layout, and the Hugging Face
directory: time to ready, memory, and decode speed, each measured in a fresh process.

1. Convert the model twice with `jaxserve convert --format mapped` into a temporary directory:
   `--linear-layout feature-major` (what a CPU conversion stores for a model that a CPU runs turned:
   jaxserve/loader/turned.py) and `--linear-layout model` (every mapped checkpoint before it). `--quantization
   int8` converts both with int8 linear layers and LM head.
2. For each round, and each checkpoint in turn, two child processes, each with `--cpu-matmul-library auto`:
   - start: `LLM(dir, max_num_seqs=4, token_buckets=[4], max_model_len=256)` timed from the process start,
     then VmRSS and VmHWM;
   - speed: `LLM(dir, max_num_seqs=16, token_buckets=(1, 4, 16, 64), max_model_len=1024)` (or the model's
     context, if shorter), then greedy
     generation at concurrency 1, 4 and 16 (the second of two calls each), output tok/s.
3. Print each figure's range over the rounds, the ratio to the model's own layout, and check that every
   checkpoint gave the same tokens.

    ./dev run python benchmarks/mapped_layout.py --model ~/.cache/jaxserve-peers/models/llama110m-random
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
CONCURRENCY = (1, 4, 16)


def child(model: str, mode: str, new_tokens: int, buckets: tuple[int, ...]) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.config import ModelConfig
    small = mode == "start"
    context = min(256 if small else 1024, ModelConfig.from_pretrained(model).max_position_embeddings)
    llm = LLM(model, cpu_matmul_library="auto", max_num_seqs=4 if small else 16,
              token_buckets=[4] if small else buckets, max_model_len=context)
    result = {"ready_s": time.perf_counter() - START}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                result[key] = int(value.split()[0]) / 1024
    if small:
        return result
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for n in CONCURRENCY:
        prompts = [[1, 100 + i, 200 + i, 300 + i] for i in range(n)]
        llm.generate(prompts, greedy)
        started = time.perf_counter()
        outputs = llm.generate(prompts, greedy)
        result[f"tok_s_{n}"] = n * new_tokens / (time.perf_counter() - started)
        result[f"tokens_{n}"] = [o.outputs[0].token_ids for o in outputs]
    return result


def run_child(model: str, mode: str, args) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", model, mode, str(args.new_tokens),
                           args.speed_buckets], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def span(values: list[float], digits: int = 1) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else f"{low:.{digits}f}-{high:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--quantization", choices=["int8"], default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--speed-buckets", default="1,4,16,64", help="token buckets of the speed runs' engines")
    args = parser.parse_args(argv)
    from jaxserve.loader.convert import convert
    with tempfile.TemporaryDirectory() as tmp:
        quantized = dict(quantization=args.quantization, quantize_lm_head=args.quantization is not None)
        checkpoints = {
            "mapped, stored feature-major": convert(args.model, Path(tmp) / "turned", format="mapped",
                                                    linear_layout="feature-major", **quantized),
            "mapped, the model's own layout": convert(args.model, Path(tmp) / "own", format="mapped",
                                                      linear_layout="model", **quantized),
        }
        if args.quantization is None:
            checkpoints["Hugging Face directory"] = args.model
        runs = {name: [] for name in checkpoints}
        for _ in range(args.rounds):
            for name, path in checkpoints.items():
                runs[name].append(run_child(str(path), "start", args) | {"speed": run_child(str(path), "speed", args)})
    tokens = {name: [r["speed"][f"tokens_{n}"] for r in rs for n in CONCURRENCY] for name, rs in runs.items()}
    reference = tokens["mapped, the model's own layout"][:len(CONCURRENCY)]
    assert all(t[i * len(CONCURRENCY):(i + 1) * len(CONCURRENCY)] == reference for t in tokens.values()
               for i in range(args.rounds)), "the checkpoints gave different tokens"
    base = runs["mapped, the model's own layout"]
    print("| checkpoint | ready s | RSS / peak MB | " + " | ".join(f"tok/s, conc {n} (ratio)" for n in CONCURRENCY)
          + " |")
    print("|---|---:|---:|" + "---:|" * len(CONCURRENCY))
    for name, rs in runs.items():
        cells = [span([r["ready_s"] for r in rs], 2),
                 f"{span([r['VmRSS'] for r in rs], 0)} / {span([r['VmHWM'] for r in rs], 0)}"]
        for n in CONCURRENCY:
            speeds = [r["speed"][f"tok_s_{n}"] for r in rs]
            ratio = sum(speeds) / sum(r["speed"][f"tok_s_{n}"] for r in base)
            cells.append(f"{span(speeds)} ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("every checkpoint gave the same greedy tokens at every concurrency")
    print("Reproduce: ./dev run python benchmarks/mapped_layout.py " + shlex.join(argv if argv is not None
                                                                                  else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]), tuple(map(int, sys.argv[5].split(","))))))
        sys.exit(0)
    sys.exit(main())
