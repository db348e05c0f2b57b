"""Speculative decoding, on vs off, in one run on one machine: output tokens per second of the offline engine
at concurrency 1, 4 and 16 on two workloads, acceptance per draft position beside each figure, and the cost
of a (K+1)-token step against a 1-token step at batch 1.

1. Workloads. `grounded`: a story told twice and begun a third time (stories260K's own continuation leaves
   the story after a few words, so prompt lookup finds its next tokens in about one step of eight).
   `retold`: the model's own greedy story from an opening, then the opening again: the answer is in the
   prompt, as in a request to quote, summarise or edit a text (what prompt lookup is for). `random`: random
   token prompts, as `../shared/peers/side_by_side.sh` sends. Each request asks for `--max-tokens` greedy
   tokens with `ignore_eos`. `--write-prompts FILE` writes one workload's prompts as token ids in `jaxserve
   bench serve`'s jsonl format and exits (`benchmarks/speculative_vs_llama_cpp.sh` serves them).
2. For each configuration (`off`, `ngram`, and `draft` when `--draft-model` is given) one engine is built
   and warmed up; each concurrency runs `--requests` requests (at most that many at once: max_num_seqs =
   the concurrency) and is timed from the first add to the last token. The greedy outputs of every
   speculative run are checked against `off`'s, token for token.
3. Beside each speculative figure, its ceiling: the speed-up over `off` if a verify step cost what a plain
   step costs, i.e. output tokens over the steps left once the accepted drafts are taken out,
   tokens / (tokens - accepted). A workload whose answers the proposer rarely finds in the text has a low
   ceiling whatever the engine does; the measured figure over the ceiling is what drafting costs. Adaptive
   drafting (the default) pauses where drafts don't pay, which lowers the ceiling with them; `--always-draft`
   turns it off, so the ceiling is the workload's.
4. Step cost: the runner runs one decode span of 1 token and one of K + 1 tokens (K drafts) for a single
   sequence, many times each; the ratio of the median times is printed.
Prints one JSON line per measurement and a markdown table at the end. `--summarize FILE.jsonl` instead
reads the levels `benchmarks/speculative_vs_llama_cpp.sh` served and prints their table (ngram / off per
round and over all rounds), writing it beside FILE as FILE.summary.json.

    ./dev run python benchmarks/speculative.py --model ../shared/models/stories260K [--draft-model DIR]
    ./dev run python benchmarks/speculative.py --model DIR --write-prompts retold.jsonl --workload retold
    ./dev run python benchmarks/speculative.py --summarize served.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from jaxserve import LLM, SamplingParams
from jaxserve.scheduling.step import ScheduledSeq, StepPlan

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball. She wanted to play with it, but it was too high.")


WORKLOADS = ("grounded", "retold", "random")


def workload(llm: LLM, kind: str, count: int, prompt_tokens: int, max_tokens: int = 64,
             seed: int = 0) -> list[list[int]]:
    """`count` prompts (token ids) of one workload (see the module's docstring)."""
    tokenizer = llm.get_tokenizer()
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    if kind == "random":
        return [[1] + [rng.randrange(3, vocab) for _ in range(prompt_tokens - 1)] for _ in range(count)]
    words = STORY.split()
    cuts = [" ".join(words[:rng.randint(3, len(words) // 2)]) for _ in range(count)]
    if kind == "grounded":
        return [tokenizer.encode(f"{STORY} {STORY} {cut}") for cut in cuts]
    openings = [tokenizer.encode(cut) for cut in cuts]
    told = llm.generate(openings, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o + list(t.outputs[0].token_ids) + o[1:] for o, t in zip(openings, told)]  # o[1:]: no second BOS


def run_load(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    return len(prompts) * max_tokens / seconds, [outputs[i] for i in ids]


def step_cost(llm: LLM, k: int, repeats: int) -> float:
    """Median seconds of a batch-1 decode span of k + 1 tokens over one of 1 token (a runner of its own)."""
    runner = llm.engine.runner
    pages = list(range(1, 1 + (256 + k) // llm.engine.cache_config.page_size + 1))

    def median(tokens: int) -> float:
        times = []
        for _ in range(repeats):
            seq = dataclasses.replace(ScheduledSeq.for_sequence(0, pages, 200, [5] * tokens),
                                      num_draft_tokens=tokens - 1)
            start = time.perf_counter()
            runner.launch(StepPlan.of([seq])).read()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    median(1), median(k + 1)  # warm
    return median(k + 1) / median(1)


def write_prompts(llm: LLM, path: str, kind: str, count: int, prompt_tokens: int, max_tokens: int) -> None:
    """The workload's prompts, one `{"prompt": [ids], "max_tokens": n}` a line (`jaxserve bench serve
    --dataset-name jsonl`), for a served comparison on the same token ids."""
    with open(path, "w") as f:
        for prompt in workload(llm, kind, count, prompt_tokens, max_tokens):
            f.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")


TARGET = 0.97  # issue 54: speculation on serves at least this fraction of speculation off's tok/s


def served_summary(rows: list[dict]) -> tuple[list[dict], str]:
    """The served levels (`speculative-served` JSON lines) as one row per model, workload and concurrency:
    off and ngram tok/s per round, ngram / off per round and over all rounds (summed tok/s), acceptance,
    the share of steps that drafted, and ngram / llama-server where it ran. Returns the rows and a markdown
    table that ends with the rows under TARGET."""
    levels: dict[tuple, dict] = {}
    for r in rows:
        if r.get("bench") != "speculative-served":
            continue
        level = levels.setdefault((r["model"], r["workload"], r["concurrency"]), {})
        level.setdefault(r["stack"], []).append(r)
    out = []
    for (model, kind, c), stacks in levels.items():
        off = {r.get("round", 1): r["output_tok_s"] for r in stacks.get("jaxserve-off", [])}
        ngram = {r.get("round", 1): r for r in stacks.get("jaxserve-ngram", [])}
        rounds = sorted(set(off) & set(ngram))
        if not rounds:
            continue
        drafted = sum(ngram[n]["draft_tokens"] for n in rounds)
        steps = sum(ngram[n].get("steps", 0) for n in rounds)
        row = {"model": model, "workload": kind, "concurrency": c, "rounds": rounds,
               "off_tok_s": [off[n] for n in rounds], "ngram_tok_s": [ngram[n]["output_tok_s"] for n in rounds],
               "ratio_per_round": [round(ngram[n]["output_tok_s"] / off[n], 3) for n in rounds],
               "ratio": round(sum(ngram[n]["output_tok_s"] for n in rounds) / sum(off[n] for n in rounds), 3),
               "acceptance": round(sum(ngram[n]["accepted_tokens"] for n in rounds) / drafted, 3) if drafted else None,
               "steps_drafting": round(sum(ngram[n].get("steps_drafting", 0) for n in rounds) / steps, 3)
               if steps else None}
        llama = stacks.get("llama-server")
        if llama:
            row["ngram_over_llama_server"] = round(sum(row["ngram_tok_s"]) / len(rounds) / llama[0]["output_tok_s"], 3)
        out.append(row)
    lines = ["| model | workload | conc | off tok/s | ngram tok/s | ngram / off per round | ngram / off | "
             "acceptance | steps drafting | ngram / llama-server |", "|---|---|---:|---|---|---|---:|---:|---:|---:|"]
    for r in out:
        share = "" if r["steps_drafting"] is None else f"{100 * r['steps_drafting']:.0f}%"
        lines.append(f"| {r['model']} | {r['workload']} | {r['concurrency']} | "
                     f"{', '.join(map(str, r['off_tok_s']))} | {', '.join(map(str, r['ngram_tok_s']))} | "
                     f"{', '.join(f'{x:.2f}x' for x in r['ratio_per_round'])} | **{r['ratio']:.2f}x** | "
                     f"{'' if r['acceptance'] is None else r['acceptance']} | {share} | "
                     f"{r.get('ngram_over_llama_server', '')} |")
    under = [f"{r['model']} {r['workload']} {r['concurrency']} ({r['ratio']:.2f}x)" for r in out if r["ratio"] < TARGET]
    lines.append(f"\nngram / off under {TARGET}x: {', '.join(under) if under else 'none'}")
    return out, "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="the model's directory (required except with --summarize)")
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="random workload's prompt length")
    ap.add_argument("--step-repeats", type=int, default=30)
    ap.add_argument("--always-draft", action="store_true",
                    help="adaptive_drafting off: draft whenever the proposer can (the workload's own ceiling)")
    ap.add_argument("--workload", choices=WORKLOADS, default=None, help="run (or write) this workload only")
    ap.add_argument("--write-prompts", default=None, metavar="FILE",
                    help="write --workload's prompts (--requests of them) as jsonl token ids and exit")
    ap.add_argument("--summarize", default=None, metavar="FILE",
                    help="print the table of a served run's levels (speculative_vs_llama_cpp.sh) and exit")
    args = ap.parse_args()
    if args.summarize:
        rows = [json.loads(line) for line in open(args.summarize) if line.startswith("{")]
        summary, table = served_summary(rows)
        with open(args.summarize.removesuffix(".jsonl") + ".summary.json", "w") as f:
            json.dump(summary, f, indent=1)
        print(table)
        return 0
    if not args.model:
        ap.error("--model is required (except with --summarize)")
    kinds = [args.workload] if args.workload else list(WORKLOADS)
    if args.write_prompts:
        # Two step programs will do: the prompts are made once, not timed.
        llm = LLM(args.model, max_num_seqs=16, max_num_batched_tokens=256, token_buckets=(16, 256))
        write_prompts(llm, args.write_prompts, kinds[0], args.requests, args.prompt_tokens, args.max_tokens)
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    configs = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                         "prompt_lookup_max": 4}}
    if args.draft_model:
        configs["draft"] = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
    for spec in configs.values():
        if spec is not None and args.always_draft:
            spec["adaptive_drafting"] = False
    rows, reference = [], {}
    for name, spec in configs.items():
        for concurrency in levels:
            llm = LLM(args.model, max_num_seqs=concurrency, speculative_config=spec,
                      max_num_batched_tokens=max(64, concurrency * (args.k + 1)))
            for kind in kinds:
                prompts = workload(llm, kind, max(args.requests, concurrency), args.prompt_tokens, args.max_tokens)
                stats = llm.engine.stats
                before = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens,
                          list(stats.spec_accepted_per_pos))
                tok_s, outputs = run_load(llm, prompts, args.max_tokens)
                drafts = stats.spec_drafts - before[0]
                accepted = stats.spec_accepted_tokens - before[2]
                produced = len(prompts) * args.max_tokens
                per_pos = [a - (before[3][i] if i < len(before[3]) else 0)
                           for i, a in enumerate(stats.spec_accepted_per_pos)]
                row = {"bench": "speculative", "model": args.model, "config": name, "workload": kind,
                       "concurrency": concurrency, "output_tok_s": round(tok_s, 1),
                       "acceptance": round(accepted / max(stats.spec_draft_tokens - before[1], 1), 3),
                       "ceiling": round(produced / (produced - accepted), 2),
                       "per_position": [round(a / drafts, 3) for a in per_pos] if drafts else [],
                       "compilations_after_warmup": llm.engine.compilations_since_warmup}
                key = (kind, concurrency)
                if name == "off":
                    reference[key] = outputs
                else:
                    row["same_tokens_as_off"] = outputs == reference.get(key)
                rows.append(row)
                print(json.dumps(row), flush=True)
            if name != "off" and concurrency == levels[0]:
                ratio = step_cost(llm, args.k, args.step_repeats)
                print(json.dumps({"bench": "speculative-step-cost", "model": args.model, "k": args.k,
                                  "k_plus_1_over_1": round(ratio, 3)}), flush=True)
            del llm
    off = {(r["workload"], r["concurrency"]): r["output_tok_s"] for r in rows if r["config"] == "off"}
    print("\n| workload | concurrency | config | out tok/s | vs off | ceiling | acceptance | per position |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for r in rows:
        ratio = r["output_tok_s"] / off[(r["workload"], r["concurrency"])]
        spec = r["config"] != "off"
        print(f"| {r['workload']} | {r['concurrency']} | {r['config']} | {r['output_tok_s']} | {ratio:.2f}x | "
              f"{f'{r['ceiling']:.2f}x' if spec else ''} | {r['acceptance'] if spec else ''} | "
              f"{', '.join(map(str, r['per_position']))} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
