"""What a grammar mask costs: output tok/s of N concurrent JSON-Schema requests beside N unconstrained ones.

1. Build `LLM(model, max_num_seqs=N)` and warm it up (every program compiled before anything is timed).
2. Each round generates for N prompts at once, `--max-tokens` each, sampled with a per-request seed:
   once *unconstrained* (`ignore_eos`, so every request runs its full length), once under a JSON Schema
   with nested objects, arrays, enums and required fields (a request stops when its JSON is complete or
   is closed within its budget). The two kinds alternate so machine noise hits both alike.
3. Output tok/s = output tokens of the round / its wall time. It prints the medians, their ratio (the claim:
   a ratio from one run, never absolute times from a shared machine), how many constrained outputs
   parsed as JSON, and the command that reproduces the run.

The constrained rounds pay for llguidance filling a `[N, vocab/32]` bitmask on the host each step, for
the device applying it, and for the synchronous step (a grammar must see token N before it can allow
token N+1, so the host cannot plan a step ahead as it does for unconstrained decoding).

    ./dev run python benchmarks/structured_masking.py [--model DIR] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

from jaxserve import LLM, SamplingParams
from jaxserve.entrypoints.args import parse_token_buckets
from jaxserve.sampling.grammar import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "friends": {"type": "array", "maxItems": 3,
                    "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                               "close": {"type": "boolean"}},
                              "required": ["name", "close"]}},
    },
    "required": ["name", "age", "mood", "friends"],
}


def timed_round(llm: LLM, prompts: list[str], make_params) -> tuple[float, int, list[str]]:
    params = [make_params(i) for i in range(len(prompts))]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outs]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens, texts


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="../shared/models/stories260K", help="Hugging Face model directory")
    p.add_argument("--concurrency", type=int, default=16, help="requests generated at once")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind, after one untimed pair")
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated step sizes to compile (default: the engine's, 1, 2, 4, ... 2048)")
    a = p.parse_args(argv)

    buckets = parse_token_buckets(a.token_buckets) if a.token_buckets else None
    llm = LLM(a.model, max_num_seqs=a.concurrency, token_buckets=buckets)
    spec = StructuredOutputsParams(json=SCHEMA)
    prompts = [f"Person {i}:" for i in range(a.concurrency)]

    def free(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=a.max_tokens, ignore_eos=True)

    def constrained(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=i, max_tokens=a.max_tokens, structured_outputs=spec)

    timed_round(llm, prompts, free)  # untimed pair: grammar compilation and first-call effects stay out
    timed_round(llm, prompts, constrained)
    free_rates, json_rates, json_tokens, valid = [], [], [], 0
    for _ in range(a.rounds):
        free_rates.append(timed_round(llm, prompts, free)[0])
        rate, tokens, texts = timed_round(llm, prompts, constrained)
        json_rates.append(rate)
        json_tokens.append(tokens)
        valid += sum(map(parses, texts))
    assert llm.engine.compilations_since_warmup == 0, "masking must not compile after warm-up"

    vocab = llm.engine.tokenizer.vocab_size
    ours, base = statistics.median(json_rates), statistics.median(free_rates)
    print(json.dumps({"model": os.path.basename(os.path.normpath(a.model)), "vocab": vocab,
                      "concurrency": a.concurrency, "max_tokens": a.max_tokens,
                      "unconstrained_tok_s": free_rates, "json_schema_tok_s": json_rates,
                      "json_schema_tokens": json_tokens, "json_valid": valid, "json_total": a.rounds * a.concurrency}))
    print(f"\n{a.concurrency} concurrent requests, {os.cpu_count()} CPUs, vocab {vocab}:")
    print("| requests | output tok/s (median) | ratio |\n|---|---:|---:|")
    print(f"| unconstrained | {base:.1f} | 1.00 |")
    print(f"| JSON Schema | {ours:.1f} | {ours / base:.2f} |")
    print(f"constrained outputs that parse as JSON: {valid}/{a.rounds * a.concurrency}")
    print("Reproduce: ./dev run python " + shlex.join(["benchmarks/structured_masking.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
