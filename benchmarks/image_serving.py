"""Images through the server: requests/s and TTFT with 1 and 4 images a request against text only, and the
encoder cache's effect (one image repeated against a new image every request).

1. Serves a vision checkpoint (default: the tiny random Gemma 3 of tests/fixtures/vlm/gemma3) with `jaxserve
   serve` in a subprocess, prefix caching off so that a repeated image can only be found in the encoder
   cache (the text comes first in each message and differs per request anyway).
2. Loads it with `jaxserve bench serve`'s own pieces (`--dataset-name random-mm`: random text of the same
   length in every case, then the images as data: URLs), `--requests` per case at `--max-concurrency`,
   `--ignore-eos`. The cases take turns for `--rounds` rounds, each round with fresh text and fresh
   images (new seeds), so machine noise and warm caches hit them alike; each figure is the median over
   the rounds.
3. Prints the table, each case's ratio to text only (the claim: ratios side by side in one run, never
   absolute times from a shared machine), repeated over distinct images, and the command to reproduce.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/image_serving.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from jaxserve.bench import datasets, serve

ROOT = Path(__file__).resolve().parents[1]
# name: (images a request, distinct images in the whole case; 0: every image new)
CASES = {"text only": (0, 0), "1 image": (1, 0), "4 images": (4, 0), "1 image, repeated": (1, 1)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "vlm" / "gemma3"))
    p.add_argument("--input-len", type=int, default=64, help="text tokens of each request (the fixture's tokenizer)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--image-size", type=int, default=256, help="height and width of the images sent")
    p.add_argument("--requests", type=int, default=16, help="requests per case and round")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve-args", default="--max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 256",
                   help="more `jaxserve serve` flags")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "jaxserve", "serve", "--model", a.model, "--port", str(port),
               "--no-prefix-caching", "--disable-log-requests", *shlex.split(a.serve_args)]
    log = tempfile.NamedTemporaryFile("w+", prefix="image_serving-", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)  # a pipe could fill
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); its log, {log.name}: "
                               f"{Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("the server was not ready in 600 s")


def run_case(a, base: str, model: str, tokenizer, images: int, distinct: int, seed: int) -> dict:
    requests = datasets.random_mm_requests(
        a.requests, a.input_len, a.output_len, 0.0, seed, tokenizer, base_items=images, limit=max(images, 1),
        buckets={(a.image_size, a.image_size, 1): 1.0}, num_distinct_images=distinct)
    results, duration = asyncio.run(serve.run_level(
        base, model, requests, chat=True, rate=float("inf"), burstiness=1.0, max_concurrency=a.max_concurrency,
        temperature=0.0, ignore_eos=True, seed=seed, progress=False))
    summary = serve.summarize(results, duration, [50])
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    tokenizer = datasets.load_tokenizer(a.model)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(a, port)
    try:
        model = serve.served_model(base)
        # One untimed round first: the server's first requests (connections, first images) stay out.
        run_case(a, base, model, tokenizer, 4, 0, seed=10_000)
        rows = {name: [] for name in CASES}
        for round_ in range(a.rounds):
            for k, (name, (images, distinct)) in enumerate(CASES.items()):
                s = run_case(a, base, model, tokenizer, images, distinct, seed=100 * round_ + k)
                rows[name].append((s["request_throughput"], s["ttft_ms"]["median"],
                                   s["total_input_tokens"] / s["completed"]))
                print(f"round {round_ + 1}, {name}: {s['request_throughput']:.2f} req/s, TTFT p50 "
                      f"{s['ttft_ms']['median']:.1f} ms", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    median = {name: [statistics.median(column) for column in zip(*values)] for name, values in rows.items()}
    text_rps, text_ttft, _ = median["text only"]
    print(f"\nImages through the server: {Path(a.model).name}, {a.requests} requests per case and round at "
          f"concurrency {a.max_concurrency}, {a.input_len} text tokens, {a.output_len} output tokens, "
          f"{a.image_size}x{a.image_size} JPEG images; medians of {a.rounds} rounds ({os.cpu_count()} CPUs, "
          f"{platform.machine()}, a shared machine: the ratios are the claim)\n")
    print("| case | prompt tokens / request | req/s | TTFT p50 ms | req/s vs text only | TTFT vs text only |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (rps, ttft, prompt) in median.items():
        print(f"| {name} | {prompt:.0f} | {rps:.2f} | {ttft:.1f} | {rps / text_rps:.2f}x | {ttft / text_ttft:.2f}x |")
    (rps_new, ttft_new, _), (rps_rep, ttft_rep, _) = median["1 image"], median["1 image, repeated"]
    print(f"\nencoder cache, one image repeated against a new one each request: {rps_rep / rps_new:.2f}x req/s, "
          f"{ttft_rep / ttft_new:.2f}x TTFT")
    print("Reproduce: PYTHONPATH=$PWD .venv/bin/python " + shlex.join(["benchmarks/image_serving.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
