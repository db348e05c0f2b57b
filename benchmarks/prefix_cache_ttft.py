"""Time to first token with a long shared system prompt: cold (prefix cache emptied) vs warm (cached).

1. Build a random Llama big enough for prefill to dominate (default ~100M parameters: hidden 768,
   12 layers, vocab 32000, tied embeddings) and one engine over it with prefix caching on; warm-up
   compiles every program before anything is timed.
2. Each round sends two requests of `system prompt + a fresh question` (token ids, max_tokens 1, so the
   first token is the whole answer): *cold* right after `reset_prefix_cache()`, which prefills every
   token, then *warm*, which finds the system prompt's pages cached and prefills only the question.
   Cold and warm alternate so machine noise hits both alike.
3. It prints the medians, their ratio (the claim: ratios side by side in one run, never absolute times
   from a shared machine) and the command that reproduces the run.

Run: ./dev run python benchmarks/prefix_cache_ttft.py  (add --help for the knobs)
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import Engine, EngineArgs, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.engine.builder import build_from_module
from jaxserve.entrypoints.args import parse_token_buckets
from jaxserve.text.tokenizer import Tokenizer
from jaxserve.model.registry import random_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--system-tokens", type=int, default=2000, help="length of the shared system prompt")
    p.add_argument("--question-tokens", type=int, default=24, help="length of each request's own part")
    p.add_argument("--rounds", type=int, default=10, help="cold/warm pairs measured (after one untimed pair)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated step sizes to compile (default: the engine's, powers of 2 up to the budget)")
    return p.parse_args(argv)


def build_engine(a: argparse.Namespace) -> Engine:
    max_model_len = 1 << (a.system_tokens + a.question_tokens + 8).bit_length()
    config = ModelConfig(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden,
                         intermediate_size=a.intermediate, num_layers=a.layers, num_heads=a.heads,
                         num_kv_heads=a.kv_heads, head_dim=a.hidden // a.heads,
                         max_position_embeddings=max_model_len, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    args = EngineArgs(max_num_seqs=2, max_model_len=max_model_len, page_size=a.page_size,
                      max_num_batched_tokens=a.max_num_batched_tokens,
                      token_buckets=parse_token_buckets(a.token_buckets) if a.token_buckets else None)
    model = random_model(config, jnp.float32, a.seed)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    print(f"model: random Llama, {n_params / 1e6:.1f}M parameters (hidden {a.hidden}, {a.layers} layers, "
          f"vocab {a.vocab}), float32, max_model_len {max_model_len}", flush=True)
    # Token-id prompts: the byte-level tokenizer only detokenizes the sampled ids (unknown ids decode to "").
    built = build_from_module(args, "random-llama", model, config, Tokenizer.byte_level(), jnp.float32)
    engine = Engine(args, built=built)
    print(f"warm-up: compiled in {engine.warmup():.1f}s", flush=True)
    return engine


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the step that returned the first token; and the cached-token count."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return time.perf_counter() - start, out.num_cached_tokens


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    engine = build_engine(a)
    rng = random.Random(a.seed)

    def tokens(n):
        return [rng.randrange(3, a.vocab) for _ in range(n)]

    system = [1] + tokens(a.system_tokens - 1)
    expected_hit = (a.system_tokens // a.page_size) * a.page_size
    cold, warm = [], []
    for round_ in range(a.rounds + 1):  # round 0 is untimed: first-call effects stay out of the numbers
        engine.reset_prefix_cache()
        t_cold, hit_cold = time_to_first_token(engine, system + tokens(a.question_tokens))
        t_warm, hit_warm = time_to_first_token(engine, system + tokens(a.question_tokens))
        assert hit_cold == 0 and hit_warm == expected_hit, (hit_cold, hit_warm, expected_hit)
        if round_:
            cold.append(t_cold)
            warm.append(t_warm)
            print(f"round {round_}: cold {t_cold * 1e3:.1f} ms, warm {t_warm * 1e3:.1f} ms", flush=True)
    assert engine.compilations_since_warmup == 0, "a prefix hit must not compile a new program"
    prompt_len = a.system_tokens + a.question_tokens
    c, w = statistics.median(cold), statistics.median(warm)
    print()
    print(f"Prefix caching, TTFT for a {prompt_len}-token prompt sharing a {a.system_tokens}-token system "
          f"prompt (median of {a.rounds} rounds; {os.cpu_count()} CPUs, {platform.machine()}, "
          f"JAX {jax.__version__} on {jax.default_backend()}):")
    print()
    print("| request | tokens prefilled | TTFT median (ms) | TTFT min..max (ms) |")
    print("| --- | --- | --- | --- |")
    print(f"| cold (cache emptied) | {prompt_len} | {c * 1e3:.1f} | {min(cold) * 1e3:.1f}..{max(cold) * 1e3:.1f} |")
    print(f"| warm (system prompt cached) | {prompt_len - expected_hit} | {w * 1e3:.1f} | "
          f"{min(warm) * 1e3:.1f}..{max(warm) * 1e3:.1f} |")
    print()
    print(f"cold / warm TTFT ratio: {c / w:.1f}x")
    print("Reproduce: ./dev run python " + shlex.join(["benchmarks/prefix_cache_ttft.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
