"""Output tokens/s with four LoRA adapters in the batch against none (issue 31, item 3: at least 0.8x).

1. Build the random 124.7M Llama of ../shared/peers (hidden 768, 12 layers, 12 heads / 4 KV heads,
   intermediate 2048, vocab 32000, untied, float32) once, and two engines over the same weights: one
   plain, one with `enable_lora` (4 slots of rank 16). Write four random rank-16 PEFT adapters over all
   seven projections (B non-zero, so the adapters really change the output) into a temporary folder.
2. A round is `--concurrency` requests queued at once (random `--prompt-tokens` prompts, greedy,
   `--output-tokens` each with ignore_eos), run to the end; tok/s = output tokens / wall time. The LoRA
   engine's requests take the four adapters in turn, so every step mixes all of them. Plain and LoRA
   rounds alternate (one untimed pair first) so machine noise hits both alike.
3. It prints both medians, their ratio (the claim: a ratio from one run) and the command. Run it only on
   a quiet machine (`uptime` load below 2.5 on the shared CPUs).

    ./dev run python benchmarks/lora_throughput.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxserve import Engine, EngineArgs, LoRARequest, SamplingParams
from jaxserve.config import ModelConfig
from jaxserve.engine.builder import build_from_module
from jaxserve.lora.adapter import MODULE_BLOCKS, TARGET_MODULES, module_shape
from jaxserve.model.registry import random_model
from jaxserve.text.tokenizer import Tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="plain/LoRA pairs measured (after one untimed pair)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=768, help="model width (heads of 64; smaller for a smoke run)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--target-itl-ms", type=float, default=None,
                   help="both engines' ITL cap (default: each derives its own at warm-up; 0: no cap)")
    return p.parse_args(argv)


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> None:
    """A random PEFT adapter over every projection: N(0, 1/sqrt(in)) A, small non-zero B."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGET_MODULES:
            d_in, d_out = module_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_BLOCKS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, d_in ** -0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.01, (d_out, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(TARGET_MODULES)}))


def output_tokens_per_second(engine: Engine, prompts: list[list[int]], loras: list[LoRARequest | None],
                             output_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt, lora in zip(prompts, loras):
        engine.add_request(prompt, params, lora_request=lora)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    assert produced == len(prompts) * output_tokens, produced
    return produced / elapsed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    heads = a.hidden // 64
    config = ModelConfig(model_type="llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_layers=a.layers, num_heads=heads, num_kv_heads=max(1, heads // 3), head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = random_model(config, jnp.float32, a.seed)
    common = dict(max_num_seqs=a.concurrency, max_model_len=a.prompt_tokens + a.output_tokens + 16,
                  max_num_batched_tokens=a.max_num_batched_tokens, target_itl_ms=a.target_itl_ms)
    engines = {}
    for name, extra in (("plain", {}), ("lora", dict(enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank))):
        args = EngineArgs(**common, **extra)
        engines[name] = Engine(args, built=build_from_module(args, "llama-124.7m-random", model, config,
                                                             Tokenizer.byte_level(), jnp.float32))
        print(f"{name}: warm-up {engines[name].warmup():.1f}s", flush=True)
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(a.adapters):
            write_adapter(Path(tmp) / f"adapter{i}", config, a.rank, a.seed + 1 + i)
            adapters.append(LoRARequest(f"adapter{i}", i + 1, str(Path(tmp) / f"adapter{i}")))
        loras = [adapters[i % a.adapters] for i in range(a.concurrency)]
        results = {"plain": [], "lora": []}
        for round_ in range(a.rounds + 1):  # round 0 is untimed
            prompts = [[rng.randrange(3, config.vocab_size) for _ in range(a.prompt_tokens)]
                       for _ in range(a.concurrency)]
            plain = output_tokens_per_second(engines["plain"], prompts, [None] * a.concurrency, a.output_tokens)
            lora = output_tokens_per_second(engines["lora"], prompts, loras, a.output_tokens)
            if round_:
                results["plain"].append(plain)
                results["lora"].append(lora)
                print(f"round {round_}: plain {plain:.1f} tok/s, {a.adapters} adapters {lora:.1f} tok/s", flush=True)
    for engine in engines.values():
        assert engine.compilations_since_warmup == 0
    plain, lora = statistics.median(results["plain"]), statistics.median(results["lora"])
    print(f"\nrandom Llama (hidden {a.hidden}, {a.layers} layers), concurrency {a.concurrency}, prompt {a.prompt_tokens}, output {a.output_tokens}, "
          f"{os.cpu_count()} CPUs: no adapters {plain:.1f} tok/s, {a.adapters} rank-{a.rank} adapters in the batch "
          f"{lora:.1f} tok/s -> {lora / plain:.2f}x (medians of {a.rounds})")
    print("Reproduce: ./dev run python " + shlex.join(["benchmarks/lora_throughput.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
