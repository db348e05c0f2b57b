"""Quantized weights against float32 on the same text: next-token argmax agreement and perplexity (issue 27).

1. A float32 engine and one with `--quantization` (int8 / fp8, per output channel, quantized at load) are
   built over the same checkpoint. Both see the same texts through `Workbench.step`, the engine's own
   jitted step, in chunks: every position's logits.
2. The texts: with `--text FILE`, that file's tokens; else stories the float model samples itself from
   BOS (temperature 1, seeded), each up to the context, until `--tokens` tokens in all (a stories model
   writes the text it knows; a random model's tokens are as good as any).
3. Reported: the share of positions where the quantized model's argmax equals float32's, and the
   perplexity of each model on `--story` (default: stories260K's documented greedy story), its rise in %.
4. `--quantize-lm-head` adds each variant with the (untied) LM head quantized too; `--untie` scores a copy of
   a tied model whose LM head is a copy of its embedding (the same model, with a head of its own to quantize).

    ./dev run python benchmarks/quantized_accuracy.py --model ../shared/models/stories260K
    ./dev run python benchmarks/quantized_accuracy.py --model /tmp/llama110m-random --text README.md
    ./dev run python benchmarks/quantized_accuracy.py --model ../shared/models/stories260K --quantization int8 \
        --untie --quantize-lm-head
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball. She wanted to play with it, but it was too high.")
CHUNK = 256  # tokens per step: the engines' largest token bucket


def engine_kwargs(max_model_len: int, samples: bool = True) -> dict:
    """The float engine samples the texts too (decode steps of up to 4 rows); the quantized ones only score,
    in steps of up to CHUNK tokens (logits do not depend on the bucket set: a step's rows are computed alike
    in every bucket that holds them). None warms up: scoring runs the Workbench's own program (every row's
    logits), so each engine compiles what its steps use, when they first run."""
    return dict(max_num_seqs=4, max_model_len=max_model_len, max_num_batched_tokens=CHUNK,
                token_buckets=(4, CHUNK) if samples else (CHUNK,), enable_prefix_caching=False, warmup=False)


def position_scores(bench, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(argmax of each position's logits, log p of the next token) for a token sequence, [len - 1] each."""
    from jaxserve.entrypoints.research import log_softmax
    seq = bench.new_sequence(len(ids))
    argmax, logprob = [], []
    try:
        for start in range(0, len(ids), CHUNK):
            rows = bench.step([(seq, ids[start:start + CHUNK])]).logits[0]
            argmax.append(rows.argmax(-1))
            targets = ids[start + 1:start + 1 + len(rows)]
            logprob.append(log_softmax(rows[:len(targets)])[np.arange(len(targets)), targets])
    finally:
        bench.release(seq)
    return np.concatenate(argmax)[:-1], np.concatenate(logprob)


def sampled_texts(llm, tokens: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Stories the model samples from BOS until `tokens` tokens in all (each `max_len` long), story i with
    seed `seed + i`. They are sampled in one batch: a seeded request's tokens do not depend on what else
    its steps carry, so these are the stories sampled one at a time, at a fraction of the steps."""
    from jaxserve import SamplingParams
    bos = llm.get_tokenizer().encode("")[:1] or [1]
    count = -(-tokens // max_len)
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_len - 1, ignore_eos=True)
              for i in range(count)]
    return [bos + list(out.outputs[0].token_ids) for out in llm.generate([bos] * count, params)]


def compare(model: str, variants: list[dict], tokens: int = 2000, text: str | None = None, story: str = STORY,
            max_model_len: int | None = None) -> list[dict]:
    """Argmax agreement over the texts and perplexity on the story, float32 against each variant (engine
    options, e.g. {"quantization": "int8", "quantization_strategy": "weight_only"})."""
    from jaxserve.config import ModelConfig
    from jaxserve.entrypoints.research import Workbench
    max_len = min(max_model_len or 2048, ModelConfig.from_pretrained(model).max_position_embeddings)
    float_bench = Workbench.load(model, dtype="float32", **engine_kwargs(max_len))
    if text is not None:
        ids = float_bench.tokenizer.encode(Path(text).read_text())
        texts = [ids[i:i + max_len] for i in range(0, min(len(ids), tokens), max_len)]
    else:
        texts = sampled_texts(float_bench.llm, tokens, max_len)
    story_ids = float_bench.tokenizer.encode(story)
    want = [position_scores(float_bench, ids)[0] for ids in texts]
    float_ppl = float(np.exp(-position_scores(float_bench, story_ids)[1].mean()))
    results = []
    for variant in variants:
        bench = Workbench.load(model, dtype="float32", **engine_kwargs(max_len, samples=False), **variant)
        agree = sum(int((w == position_scores(bench, ids)[0]).sum()) for w, ids in zip(want, texts))
        positions = sum(len(w) for w in want)
        ppl = float(np.exp(-position_scores(bench, story_ids)[1].mean()))
        results.append({"variant": variant, "strategy": bench.model_config.linear_quantization.strategy,
                        "positions": positions, "agree": agree, "agreement": agree / positions,
                        "perplexity_float32": float_ppl, "perplexity_quantized": ppl,
                        "perplexity_rise": ppl / float_ppl - 1})
        del bench
    return results


def untied_copy(model: str, directory: Path) -> str:
    """A copy of the tied checkpoint `model` in `directory` whose LM head is a copy of its embedding table."""
    from safetensors.numpy import load_file, save_file
    source, out = Path(model), directory / f"{Path(model).name}-untied"
    out.mkdir()
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).symlink_to(f.resolve())
    tensors = load_file(source / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    return str(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", nargs="+", default=["int8", "fp8"])
    ap.add_argument("--strategies", nargs="+", default=["auto", "weight_only"],
                    help="how each quantization runs: auto (the backend's choice) and/or named strategies")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--text", default=None, help="a text file to score (default: stories the model samples)")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--quantize-lm-head", action="store_true", help="each variant also with the LM head quantized")
    ap.add_argument("--untie", action="store_true",
                    help="score a copy of the (tied) model whose LM head is a copy of its embedding")
    args = ap.parse_args(argv)
    variants = [dict(quantization=q, **({} if st == "auto" else {"quantization_strategy": st}), **head)
                for q in args.quantization for st in args.strategies
                if not (q == "fp8" and st == "dynamic_int8") and not (q == "int8" and st == "dynamic_fp8")
                for head in ([{}, {"quantize_lm_head": True}] if args.quantize_lm_head else [{}])]
    print("| model | weights | strategy | positions | argmax = float32 | perplexity float32 | perplexity quantized | rise |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    scratch = tempfile.TemporaryDirectory()
    model = untied_copy(args.model, Path(scratch.name)) if args.untie else args.model
    for r in compare(model, variants, args.tokens, args.text, max_model_len=args.max_model_len):
        weights = r["variant"]["quantization"] + (", LM head too" if r["variant"].get("quantize_lm_head") else "")
        print(f"| {Path(model).name} | {weights} | {r['strategy']} | {r['positions']} | "
              f"{100 * r['agreement']:.2f}% | {r['perplexity_float32']:.4f} | {r['perplexity_quantized']:.4f} | "
              f"{100 * r['perplexity_rise']:+.2f}% |")
    print(f"Reproduce: ./dev run python benchmarks/quantized_accuracy.py {' '.join(argv or sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
