"""`jaxserve bench latency` and `jaxserve bench throughput`: the engine through `LLM`, no server.

- latency: one batch of `batch_size` prompts of `input_len` random token ids, `output_len` new tokens each
  (ignore_eos), timed end to end `num_iters` times after `num_iters_warmup` untimed runs; also the
  prefill alone (max_tokens 1) and the decode rate derived from the two.
- throughput: `num_prompts` such prompts generated together; requests/s, output and total tokens/s.
"""

from __future__ import annotations

import time

import numpy as np

from jaxserve.sampling.params import SamplingParams


def _prompts(llm, n: int, input_len: int, seed: int) -> list[list[int]]:
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, input_len).tolist() for _ in range(n)]


def _timed(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int, num_iters_warmup: int,
            seed: int = 0) -> dict:
    prompts = _prompts(llm, batch_size, input_len, seed)
    full = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(num_iters_warmup):
        _timed(llm, prompts, full)
    # The prefix cache would turn every repeat into a cache hit: empty it so each run prefills.
    runs, prefills = [], []
    for _ in range(num_iters):
        llm.engine.reset_prefix_cache()
        prefills.append(_timed(llm, prompts, first)[0])
        llm.engine.reset_prefix_cache()
        elapsed, outputs = _timed(llm, prompts, full)
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        runs.append(elapsed)
    runs_a, prefill = np.asarray(runs), float(np.median(prefills))
    decode_s = max(float(np.median(runs_a)) - prefill, 1e-9)
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "avg_latency_s": float(runs_a.mean()), "latencies_s": runs,
            "percentiles_s": {f"p{p}": float(np.percentile(runs_a, p)) for p in (10, 25, 50, 75, 90, 99)},
            "prefill_latency_s": prefill,
            "decode_tokens_per_s": batch_size * (output_len - 1) / decode_s if output_len > 1 else None,
            "compilations_while_timed": llm.engine.compilations_since_warmup}


def throughput(llm, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    prompts = _prompts(llm, num_prompts, input_len, seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    _timed(llm, prompts[:1], params)  # untimed: first-call effects stay out
    llm.engine.reset_prefix_cache()
    elapsed, outputs = _timed(llm, prompts, params)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
            "requests_per_s": num_prompts / elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + num_prompts * input_len) / elapsed,
            "compilations_while_timed": llm.engine.compilations_since_warmup}
