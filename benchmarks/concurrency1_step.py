"""Where a concurrency-1 decode step's time goes on the host: one request, timed per engine phase.

Runs the offline engine (no HTTP) on one greedy request and wraps the phases of `Engine.step` with
timers: planning (`Scheduler.schedule`), packing the batch (`BatchBuilder.build`), the call of the
compiled program (`dispatch`: on the CPU backend a cheap program runs inside this call), waiting for the
samples (`LaunchedStep.sampled`) and advancing the request (`update_from_output`: detokenization, stop
checks). Prints the median milliseconds of each per decode step, and the step's wall time.

    ./dev run python benchmarks/concurrency1_step.py --model ../shared/models/stories260K
    ./dev run python benchmarks/concurrency1_step.py --model ~/.cache/jaxserve-peers/models/llama110m-random

It also counts the steps whose samples were ready as soon as the dispatch call returned: those ran inside
the call, so the host's work for the next step could not overlap them.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from jaxserve import LLM
from jaxserve.entrypoints.args import parse_token_buckets
from jaxserve.sampling.params import SamplingParams

PHASES = {"schedule": ("scheduler", "schedule"), "build batch": ("runner.builder", "build"),
          "dispatch": ("runner", "dispatch"), "wait for samples": None,
          "update_from_output": ("tracker", "update_from_output")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--token-buckets", default="16,64", help="few buckets: fewer programs to compile")
    args = parser.parse_args()
    buckets = parse_token_buckets(args.token_buckets)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=buckets[-1], token_buckets=buckets,
              max_model_len=512)
    engine = llm.engine
    times: dict[str, list[float]] = collections.defaultdict(list)

    def timed(owner, name: str, label: str):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                times[label].append(time.perf_counter() - start)
        setattr(owner, name, wrapper)

    for label, where in PHASES.items():
        if where is not None:
            owner = engine
            for part in where[0].split("."):
                owner = getattr(owner, part)
            timed(owner, where[1], label)
    dispatch = engine.runner.dispatch
    inline = []  # per step: were the samples ready when the dispatch call returned (the program ran inline)?

    def probed_dispatch(*a, **kw):
        launched = dispatch(*a, **kw)
        inline.append(launched.result.draws.last.is_ready())
        return launched
    engine.runner.dispatch = probed_dispatch
    read = engine._read

    def timed_read(launched):
        start = time.perf_counter()
        launched.read()  # cached by nothing: read() again below is a host copy of a ready array
        times["wait for samples"].append(time.perf_counter() - start)
        return read(launched)
    engine._read = timed_read

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompt = engine.tokenizer.encode("Once upon a time")
    for _ in range(2):  # the first run pays one-off costs
        times.clear()
        inline.clear()
        engine.add_request(prompt, params)
        walls = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    print(f"{args.model}: one request, {args.tokens} tokens; median ms per engine step")
    print(f"  wall per step: {1e3 * statistics.median(walls):.3f}")
    print(f"  steps whose samples were ready when dispatch returned: {sum(inline)}/{len(inline)}")
    for label in PHASES:
        if times[label]:
            print(f"  {label}: {1e3 * statistics.median(times[label]):.3f}")


if __name__ == "__main__":
    main()
