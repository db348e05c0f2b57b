"""The first requests after start-up against the ones after them: does warm-up leave one-off costs to them?

Builds the offline engine twice, with the warm-up batches (`BatchBuilder.warmup`) and without them, and on
each sends waves of `--wave` concurrent greedy requests of random prompts, each wave after the last has
finished: the first wave meets every program as warm-up left it, the second as the first wave left it.
Prints, per wave, the engine steps' summed time and the longest step, and each engine's first wave over
its second (1.0x: warm-up left nothing to pay).

    ./dev run python benchmarks/first_wave.py --model ../shared/models/stories260K
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from unittest import mock

import numpy as np

from jaxserve import LLM
from jaxserve.entrypoints.args import parse_token_buckets
from jaxserve.execution.runner import ModelRunner
from jaxserve.sampling.params import SamplingParams


def waves(llm: LLM, sizes: list[int], prompt_len: int, max_tokens: int, seed: int) -> tuple[list, list]:
    """(summed, longest) step milliseconds of each wave, and every request's tokens."""
    engine, rng, out, ids, tokens = llm.engine, np.random.default_rng(seed), [], [], {}
    vocab = engine.model_config.vocab_size
    for size in sizes:
        for _ in range(size):
            ids += [engine.add_request(rng.integers(3, vocab, prompt_len).tolist(),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))]
        steps = []
        while engine.has_unfinished():
            start = time.perf_counter()
            finished = engine.step()
            steps.append(1e3 * (time.perf_counter() - start))
            tokens.update((o.request_id, o.outputs[0].token_ids) for o in finished if o.finished)
        out.append((sum(steps), max(steps)))
    return out, [tokens[i] for i in ids]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--waves", default="1,1,4,4,16,16", help="requests per wave, in order")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--token-buckets", default=None, help="the engine's default unless given")
    args = parser.parse_args(argv)
    buckets = {} if args.token_buckets is None else dict(token_buckets=parse_token_buckets(args.token_buckets))
    sizes = [int(s) for s in args.waves.split(",")]
    rows, tokens = {}, {}
    for label in ("without", "with"):
        # "without": the engine as it was before the warm-up batches, idle steps only
        skipped = mock.patch.object(ModelRunner, "run_warmup_batches", lambda self, bucket: None)
        with skipped if label == "without" else contextlib.nullcontext():
            llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, **buckets)
        rows[label], tokens[label] = waves(llm, sizes, args.prompt_len, args.max_tokens, seed=0)
        del llm
    assert tokens["with"] == tokens["without"], "the warm-up batches changed what requests get"
    print(f"\n| wave | requests | without: summed / longest step ms | with: summed / longest step ms |")
    print("|---:|---:|---|---|")
    for i, size in enumerate(sizes):
        (ws, wl), (s, l) = rows["without"][i], rows["with"][i]
        print(f"| {i + 1} | {size} | {ws:.1f} / {wl:.1f} | {s:.1f} / {l:.1f} |")
    for label, r in rows.items():
        pairs = [(r[i][0], r[i + 1][0]) for i in range(len(sizes) - 1) if sizes[i] == sizes[i + 1]
                 and (i == 0 or sizes[i - 1] != sizes[i])]
        print(f"{label} warm-up batches: first wave over the next of its size: "
              + ", ".join(f"{a / b:.2f}x" for a, b in pairs))
    print("Reproduce: ./dev run python benchmarks/first_wave.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
