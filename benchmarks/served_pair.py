"""One served level on two servers in alternation: the same requests, cut into chunks, sent to one server and
then the other, chunk by chunk, the first of each pair alternating (A B, B A, A B, ...). Each server's output
tok/s is its tokens over its summed time.

Why: on a shared 2-core machine a level's throughput swings by about 10% from one run of a few seconds to the
next. Two identical servers (stories260K, 128 requests at 4 streams, 6 rounds), one run each: 0.84-1.26x;
the same requests in 4 alternating chunks: 0.98-1.09x. Alternating chunks of a second or two cancels whatever
changes the machine's pace more slowly than a chunk; what changes faster is left (a chunk's pair still swings
by about 13%), so a level is only as sure as its number of chunks. A chunk holds at least `MIN_WAVES` times the
concurrency in requests, so the ramp and the drain of each (the first and last requests, with fewer streams
running) stay a small part of it, as in one long run.

    python benchmarks/served_pair.py --urls URL_A URL_B --model m (--dataset-path F.jsonl | --random-input-len N
        --tokenizer DIR) --num-prompts N --max-concurrency C [--first 0|1] [--save-result level.json]

Prints and saves, per server: output tok/s, tokens, seconds, and the tok/s of each chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from jaxserve.bench import datasets, serve

MIN_WAVES = 8  # a chunk's requests per stream at least
MAX_CHUNKS = 16


def chunk_count(requests: int, concurrency: int) -> int:
    return max(1, min(MAX_CHUNKS, requests // (MIN_WAVES * concurrency)))


def run_pair(urls: list[str], model: str, requests: list, warmup, concurrency: int, first: int) -> list[dict]:
    chunks = chunk_count(len(requests), concurrency)
    size = -(-len(requests) // chunks)
    results = [{"url": url, "tokens": 0, "seconds": 0.0, "failed": 0, "chunk_tok_s": []} for url in urls]
    for i in range(chunks):
        chunk = requests[i * size:(i + 1) * size]
        order = (first, 1 - first) if i % 2 == 0 else (1 - first, first)
        for s in order:
            done, seconds = asyncio.run(serve.run_level(
                urls[s], model, chunk, chat=False, rate=float("inf"), burstiness=1.0, max_concurrency=concurrency,
                temperature=0.0, ignore_eos=True, seed=0, progress=False, warmups=[warmup] if i == 0 else []))
            ok = [r for r in done if r.success]
            if not ok:
                raise serve.ServerUnreachable(f"{urls[s]}: every request failed: {done[0].error}")
            tokens = sum(r.output_tokens for r in ok)
            out = results[s]
            out["tokens"] += tokens
            out["seconds"] += seconds
            out["failed"] += len(done) - len(ok)
            out["chunk_tok_s"].append(round(tokens / seconds, 1))
    for out in results:
        out["output_tok_s"] = round(out["tokens"] / out["seconds"], 1)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--urls", nargs=2, required=True, help="the two servers' base URLs")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset-path", help="a jsonl file of prompts (as `jaxserve bench serve --dataset-name jsonl`)")
    ap.add_argument("--random-input-len", type=int, help="random token-id prompts of this length instead")
    ap.add_argument("--tokenizer", help="the tokenizer random prompts are drawn for")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, required=True)
    ap.add_argument("--max-concurrency", type=int, required=True)
    ap.add_argument("--first", type=int, choices=(0, 1), default=0, help="which server runs the first chunk")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-result", help="write the result as JSON here")
    ns = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    count = ns.num_prompts + 1  # the last: the untimed warm-up request each server gets first
    if ns.random_input_len:
        requests = datasets.random_requests(count, ns.random_input_len, ns.output_len, 0.0, ns.seed,
                                            datasets.load_tokenizer(ns.tokenizer), "ids")
    else:
        requests = datasets.jsonl_requests(ns.dataset_path, count, ns.output_len)
    results = run_pair(ns.urls, ns.model, requests[:-1], requests[-1], ns.max_concurrency, ns.first)
    report = {"concurrency": ns.max_concurrency, "requests": ns.num_prompts,
              "chunks": len(results[0]["chunk_tok_s"]), "first": ns.first, "servers": results}
    print(json.dumps(report))
    if ns.save_result:
        with open(ns.save_result, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
