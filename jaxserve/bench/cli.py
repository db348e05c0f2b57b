"""`jaxserve bench serve|latency|throughput|plot`: argument parsing and reports (the work is in the modules)."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

from jaxserve.engine_args import DEFAULT_IMAGES_PER_PROMPT, parse_mm_limits
from jaxserve.entrypoints.args import add_engine_args, engine_args_from


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark a server (serve) or the engine (latency, throughput)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    s = kinds.add_parser("serve", help="load an OpenAI-compatible server and report TTFT, TPOT, ITL, throughput")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (nothing else is contacted)")
    s.add_argument("--model", default=None, help="model name in requests (default: the first of /v1/models)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--dataset-name", choices=["random", "random-mm", "prefix-repetition", "jsonl"], default="random",
                   help="random-mm: random text and images (chat, data: URLs), as vLLM's")
    s.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\"} or {\"messages\"} per line")
    s.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or tokenizer.json: random prompts of exact token lengths")
    s.add_argument("--random-input-len", type=int, default=128)
    s.add_argument("--random-output-len", type=int, default=64)
    s.add_argument("--random-range-ratio", type=float, default=0.0)
    s.add_argument("--random-prompt-form", choices=["ids", "text"], default="ids",
                   help="with --tokenizer: send token ids or their decoded text")
    s.add_argument("--random-mm-base-items-per-request", type=int, default=1, metavar="N",
                   help="random-mm: images per request")
    s.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0, metavar="R",
                   help="random-mm: images per request drawn from [floor(N * (1 - R)), ceil(N * (1 + R))]")
    s.add_argument("--random-mm-limit-mm-per-prompt", default=None, metavar="JSON",
                   help=f'random-mm: most images a request carries, \'{{"image": 4}}\' (default '
                        f'{DEFAULT_IMAGES_PER_PROMPT}, the server\'s default limit)')
    s.add_argument("--random-mm-bucket-config", default=None, metavar="DICT",
                   help="random-mm: image sizes and their probabilities, {(height, width, 1): p, ...} (default "
                        "vLLM's: 256x256 and 720x1280, half the images each)")
    s.add_argument("--random-mm-num-distinct-images", type=int, default=0, metavar="N",
                   help="random-mm: draw every image from N made up front (1: the same image in every request, "
                        "what an encoder cache serves); default 0: every image new")
    s.add_argument("--prefix-len", type=int, default=256)
    s.add_argument("--suffix-len", type=int, default=32)
    s.add_argument("--num-prefixes", type=int, default=4)
    s.add_argument("--num-prompts", default="100",
                   help="requests per level; a comma list gives each level of the sweep its own count "
                        "(a low concurrency needs fewer requests than a high one for the same confidence)")
    s.add_argument("--request-rate", default="inf", help="requests/s, or a comma list to sweep (inf: all at once)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    s.add_argument("--max-concurrency", default=None, help="requests in flight at most; a comma list sweeps")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--ignore-eos", action="store_true", help="every request runs to its output length")
    s.add_argument("--percentiles", default="50,90,99", help="percentiles reported for each latency")
    s.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    s.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent, one at a time, before each level")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--label", default=None, help="name of this run in plots (default: the base URL)")
    s.add_argument("--save-result", default=None, metavar="FILE", help="write the full results as JSON")
    s.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=_serve)

    p = kinds.add_parser("plot", help="draw several saved results (one per server) on the same axes")
    p.add_argument("results", nargs="+", help="files written by bench serve --save-result")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=_plot)

    for name, helptext in (("latency", "batch latency of prefill and decode through LLM"),
                           ("throughput", "offline throughput of LLM over many prompts")):
        o = kinds.add_parser(name, help=helptext)
        add_engine_args(o)
        o.add_argument("--input-len", type=int, default=32)
        o.add_argument("--output-len", type=int, default=128)
        if name == "latency":
            o.add_argument("--batch-size", type=int, default=1)
            o.add_argument("--num-iters", type=int, default=5)
            o.add_argument("--num-iters-warmup", type=int, default=1)
        else:
            o.add_argument("--num-prompts", type=int, default=64)
        o.add_argument("--seed", type=int, default=0)
        o.add_argument("--output-json", default=None, metavar="FILE")
        o.set_defaults(func=_offline)


def _level_counts(text: str, levels: int) -> list[int]:
    counts = [int(n) for n in text.split(",") if n.strip()]
    if len(counts) == 1:
        counts *= levels
    if len(counts) != levels or min(counts) < 1:
        raise ValueError(f"--num-prompts takes one positive count, or one per level of the sweep ({levels}); "
                         f"got {text!r}")
    return counts


def _requests(ns, tokenizer, seed: int, count: int):
    from jaxserve.bench import datasets
    if ns.dataset_name == "random":
        return datasets.random_requests(count, ns.random_input_len, ns.random_output_len,
                                        ns.random_range_ratio, seed, tokenizer, ns.random_prompt_form)
    if ns.dataset_name == "random-mm":
        limits = parse_mm_limits(ns.random_mm_limit_mm_per_prompt)
        return datasets.random_mm_requests(
            count, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, seed, tokenizer,
            base_items=ns.random_mm_base_items_per_request, items_range_ratio=ns.random_mm_num_mm_items_range_ratio,
            limit=limits.get("image", DEFAULT_IMAGES_PER_PROMPT), buckets=ns.random_mm_bucket_config,
            num_distinct_images=ns.random_mm_num_distinct_images)
    if ns.dataset_name == "prefix-repetition":
        return datasets.prefix_repetition_requests(count, ns.prefix_len, ns.suffix_len, ns.num_prefixes,
                                                   ns.random_output_len, seed, tokenizer)
    if not ns.dataset_path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    return datasets.jsonl_requests(ns.dataset_path, count, ns.random_output_len)


def _serve(ns) -> int:
    import logging

    from jaxserve.bench import serve
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    percentiles, goodput = _floats(ns.percentiles), serve.parse_goodput(ns.goodput)
    model = ns.model or serve.served_model(ns.base_url)
    from jaxserve.bench.datasets import load_tokenizer
    tokenizer = load_tokenizer(ns.tokenizer)
    # Random datasets draw new prompts for each level (seed + level): a level must not find the previous
    # level's prompts in the server's prefix cache. (A jsonl file is what it is.)
    rates = ns.request_rate.split(",")
    concurrencies = [int(c) for c in ns.max_concurrency.split(",")] if ns.max_concurrency else [None]
    counts = _level_counts(ns.num_prompts, len(rates) * len(concurrencies))
    # Each level's requests, its untimed warm-ups last.
    per_level = [_requests(ns, tokenizer, ns.seed + 1 + i, count + ns.num_warmups) for i, count in enumerate(counts)]
    chat = ns.endpoint == "chat" or any(r.messages for level in per_level for r in level)
    if chat and any(isinstance(r.prompt, list) for level in per_level for r in level):
        raise ValueError("the chat endpoint takes text: use --random-prompt-form text")
    levels = []
    for rate in rates:
        for concurrency in concurrencies:
            count, requests = counts[len(levels)], per_level[len(levels)]
            results, duration = asyncio.run(serve.run_level(
                ns.base_url, model, requests[:count], chat=chat, rate=float(rate), burstiness=ns.burstiness,
                max_concurrency=concurrency, temperature=ns.temperature, ignore_eos=ns.ignore_eos, seed=ns.seed,
                progress=not ns.no_progress, warmups=requests[count:]))
            if not any(r.success for r in results):
                raise serve.ServerUnreachable(f"every request failed: {results[0].error}")
            levels.append({"request_rate": rate, "max_concurrency": concurrency, "burstiness": ns.burstiness,
                           "num_prompts": count,
                           "metrics": serve.summarize(results, duration, percentiles, goodput)})
    report = {"base_url": ns.base_url, "model": model, "label": ns.label or ns.base_url,
              "endpoint": "chat" if chat else "completions", "dataset": ns.dataset_name,
              "images_per_request": sum(r.images for level in per_level for r in level) / sum(map(len, per_level)),
              "command": "jaxserve " + shlex.join(ns.argv), "levels": levels}
    print(serve.table(levels))
    for level in levels:
        if "goodput" in level["metrics"]:
            print(f"goodput at concurrency {level['max_concurrency']}, rate {level['request_rate']}: "
                  f"{level['metrics']['goodput']:.2f} req/s meeting {level['metrics']['goodput_slos_ms']}")
    if ns.save_result:
        Path(ns.save_result).write_text(json.dumps(report, indent=1))
    if ns.plot:
        from jaxserve.bench.plot import plot
        for path in plot({report["label"]: levels}, ns.plot):
            print(f"plot: {path}")
    return 0


def _plot(ns) -> int:
    from jaxserve.bench.plot import plot
    results = {}
    for file in ns.results:
        report = json.loads(Path(file).read_text())
        results[report.get("label") or file] = report["levels"]
    for path in plot(results, ns.out):
        print(f"plot: {path}")
    return 0


def _offline(ns) -> int:
    import dataclasses

    from jaxserve.bench import offline
    from jaxserve.entrypoints.llm import LLM
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    if ns.bench_command == "latency":
        result = offline.latency(llm, ns.batch_size, ns.input_len, ns.output_len, ns.num_iters,
                                 ns.num_iters_warmup, ns.seed)
        print(f"batch {ns.batch_size}, {ns.input_len} in / {ns.output_len} out: avg latency "
              f"{result['avg_latency_s'] * 1000:.1f} ms, prefill {result['prefill_latency_s'] * 1000:.1f} ms, "
              f"decode {result['decode_tokens_per_s'] or 0:.1f} tok/s")
    else:
        result = offline.throughput(llm, ns.num_prompts, ns.input_len, ns.output_len, ns.seed)
        print(f"{ns.num_prompts} prompts, {ns.input_len} in / {ns.output_len} out: "
              f"{result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.1f} output tok/s, "
              f"{result['total_tokens_per_s']:.1f} total tok/s")
    result["command"] = "jaxserve " + shlex.join(ns.argv)
    print(json.dumps(result))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=1))
    return 0
