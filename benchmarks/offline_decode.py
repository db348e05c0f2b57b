"""Offline batch-1 decode speed of the `LLM` API with default settings, beside llama.cpp's `llama-bench`.

1. Build `LLM(model)` with nothing but the model (default slots, token budget and buckets: what a user
   gets), then generate greedily from a one-token prompt, `--tokens` new tokens with `ignore_eos`, a few
   times. Decode speed = (tokens - 1) / (time from the first token to the last): the same quantity as
   llama-bench's `tg` test, which times token generation after the prompt.
2. If `--llama-bench` and `--gguf` are given, run `llama-bench -p 0 -n TOKENS` on the same model in the
   same run and print the ratio (the claim is the ratio; absolute numbers on a shared machine drift).

    ./dev run python benchmarks/offline_decode.py --model DIR [--llama-bench BIN --gguf FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from jaxserve import LLM, SamplingParams


def decode_tokens_per_second(llm: LLM, tokens: int) -> float:
    """Greedy decode of `tokens` tokens after a one-token prompt; tokens/s between the first and the last."""
    engine = llm.engine
    request_id = engine.add_request([1], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    first = last = None
    count = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                last = time.perf_counter()
                first = first or last
                count += len(out.new_token_ids)
    assert count == tokens, (count, tokens)
    return (tokens - 1) / (last - first)


def llama_bench(binary: str, gguf: str, tokens: int, threads: int) -> float:
    result = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "3",
                             "-o", "json"], capture_output=True, text=True, check=True, timeout=900)
    return float(json.loads(result.stdout)[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per run (llama-bench's -n)")
    p.add_argument("--runs", type=int, default=3, help="timed runs after one untimed run")
    p.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench")
    p.add_argument("--gguf", default=None, help="the same model as GGUF, for llama-bench")
    p.add_argument("--quantization", default=None, help="LLM(quantization=...): int8 or fp8 weights")
    p.add_argument("--kv-cache-dtype", default="auto", help="LLM(kv_cache_dtype=...): auto, int8 or fp8")
    p.add_argument("--quantize-lm-head", action="store_true", help="LLM(quantize_lm_head=True): the head too")
    a = p.parse_args(argv)

    llm = LLM(a.model, quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
              quantize_lm_head=a.quantize_lm_head)
    decode_tokens_per_second(llm, a.tokens)  # untimed: first-call effects stay out of the numbers
    runs = [decode_tokens_per_second(llm, a.tokens) for _ in range(a.runs)]
    assert llm.engine.compilations_since_warmup == 0, "decoding must not compile after warm-up"
    ours = statistics.median(runs)
    print(json.dumps({"stack": "jaxserve-offline", "n_gen": a.tokens, "tok_s": ours, "runs": runs,
                      "precision": llm.engine.precision.describe()}))
    print(f"\njaxserve LLM batch-1 decode ({os.cpu_count()} CPUs, {a.quantization or 'no'} quantization, "
          f"KV {a.kv_cache_dtype}): {ours:.1f} tok/s "
          f"(median of {a.runs}: {', '.join(f'{r:.1f}' for r in runs)})")
    if a.llama_bench and a.gguf:
        theirs = llama_bench(a.llama_bench, a.gguf, a.tokens, os.cpu_count() or 1)
        print(json.dumps({"stack": "llama-bench", "n_gen": a.tokens, "tok_s": theirs}))
        print(f"llama-bench tg{a.tokens}: {theirs:.1f} tok/s -> ratio {ours / theirs:.2f}x")
    print("Reproduce: ./dev run python " + shlex.join(["benchmarks/offline_decode.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
