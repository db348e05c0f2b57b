"""Section 5 of the GPU script's flow (`gpu_kernels.py --sections e2e`): the rows it writes, in order, each
through `guarded` so one failure leaves the others' numbers. The model, its timings and the greedy check are
`gpu_engine_step.py`'s; the options are `gpu_engine_args.py`'s.

1. The greedy check of the platform's attention kernel against the reference, per --e2e-check-dtypes.
2. The copy yardstick, unless the kernel sections measured it.
3. "e2e model": the random model built and its step programs compiled (skipped when --time-budget has too
   little left); "e2e idle step": each bucket's program with no sequences (and, with --e2e-ngram, with a
   draft verified per sequence beside it).
4. "e2e decode" at each --e2e-decode-batches count (profiled where --e2e-profile-batches names it), then
   "e2e prefill".
"""

from __future__ import annotations

import traceback

import numpy as np

import gpu_common
from gpu_common import check_budget, guarded, measure_copy
from gpu_engine_step import E2EModel, build_reserve_s, e2e_check


def run_e2e(args, rows: list, checks: list) -> None:
    """A random model of Llama-3-8B's shape in --e2e-dtype through the engine (`build_from_module` + `Engine`,
    the platform's default attention): the kernel-vs-reference greedy check on a small model of the same head
    layout first, then decode steps at --e2e-decode-batches running sequences and one prefill step."""
    print(f"  greedy check: {args.e2e_check_layers}-layer model, prompts {args.e2e_check_prompts}, "
          f"{args.e2e_check_steps} steps", flush=True)
    for dtype_name in args.e2e_check_dtypes:
        try:
            check_budget()
            e2e_check(args, dtype_name, checks)
        except Exception as e:  # keep going: the timings below still say something, and the check shows FAIL
            checks.append(dict(check=f"e2e greedy {dtype_name}", ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
            if not isinstance(e, TimeoutError):
                traceback.print_exc()

    if "gbs" not in gpu_common.COPY:  # the decode section did not run (or failed): measure the yardstick here
        nbytes = args.e2e_copy_mib << 20
        guarded(rows, "copy", f"{args.e2e_copy_mib} MiB", lambda: measure_copy(nbytes))

    model: dict = {}

    def build():
        check_budget(reserve=0 if gpu_common.INTERPRET else build_reserve_s(args.e2e_layers))
        m = model["m"] = E2EModel(args)
        c = m.config
        mlp = (f"{c.num_experts} experts (top {c.num_experts_per_tok}) of intermediate {c.moe_intermediate_size}"
               if c.num_experts else f"intermediate {c.intermediate_size}")
        print(f"  model: random {'Qwen3-MoE' if c.num_experts else 'Llama'}, hidden {c.hidden_size}, {c.num_layers} "
              f"layers, {c.num_heads}/{c.num_kv_heads} heads x {c.head_dim}, {mlp}, vocab {c.vocab_size}: "
              f"{m.param_bytes / m.dtype.itemsize / 1e9:.2f}B parameters = {m.param_bytes / 1e9:.2f} GB "
              f"{m.dtype.name}; KV cache {m.kv_cache_bytes / 1e9:.2f} GB; attention {m.backend}; built in "
              f"{m.build_s:.1f} s, {len(m.engine.runner.layouts)} step programs compiled in {m.warmup_s:.1f} s",
              flush=True)
        return dict(ms=(m.build_s + m.warmup_s) * 1e3, param_bytes=m.param_bytes, kv_cache_bytes=m.kv_cache_bytes,
                    layers=c.num_layers, backend=m.backend, build_s=m.build_s, warmup_s=m.warmup_s,
                    max_model_len=c.max_position_embeddings, buckets=list(m.engine.runner.layouts))

    def idle_steps():
        """Each bucket's program with no sequence in it (every token padding, no KV read): dispatch to samples
        on the host, one call at a time. Its weights-and-sampler floor, beside the decode rows' engine steps,
        and whether a one-token program is slower than a wider one (the 16-token padding on GPUs). With
        --e2e-ngram also with every sequence verifying a draft (`BatchBuilder.warmup`'s verify batch): the
        draft rows' cost in the same program."""
        runner = need_model().engine.runner
        row = {}
        for verify in (False, True) if args.e2e_ngram else (False,):
            times = {}
            for bucket in runner.layouts:
                runner.time_idle_step(bucket, verify)  # warm
                times[bucket] = float(np.median([runner.time_idle_step(bucket, verify)
                                                 for _ in range(args.e2e_repeats * 3)]))
            what = "a draft verified per sequence" if verify else "no sequences"
            print(f"  idle step ({what}) per bucket: " + ", ".join(f"{b} tokens {t * 1e3:.2f} ms"
                                                                  for b, t in times.items()), flush=True)
            row["idle_verify_ms" if verify else "idle_ms"] = {str(b): t * 1e3 for b, t in times.items()}
        return dict(ms=min(row["idle_ms"].values()), **row)

    precision = f"{args.e2e_dtype}" + (f", {args.e2e_quantization} weights" if args.e2e_quantization else "") + (
        f" {args.e2e_quantization_strategy}" if args.e2e_quantization and args.e2e_quantization_strategy else "") + (
        f", {args.e2e_quantized_matmul} products" if args.e2e_quantized_matmul != "auto" else "") + (
        f", {args.e2e_kv_cache_dtype} KV" if args.e2e_kv_cache_dtype != "auto" else "") + (
        f", layers {args.e2e_layer_loop}" if args.e2e_layer_loop != "auto" else "") + (
        f", kv_splits {args.e2e_kv_splits}" if args.e2e_kv_splits is not None else "") + (
        f", {args.e2e_experts} experts top {args.e2e_experts_per_token}" if args.e2e_experts else "") + (
        f", ngram {args.e2e_ngram}" if args.e2e_ngram else "") + (
        f", ctx {args.e2e_context}" if args.e2e_context != 1024 else "")
    guarded(rows, "e2e model", f"{args.e2e_layers}L {precision} build+compile", build)

    def need_model():
        if "m" not in model:
            raise RuntimeError("no model: its build failed (see the 'e2e model' row)")
        return model["m"]

    guarded(rows, "e2e idle step", "per bucket, no sequences (ms: the fastest)", idle_steps)
    for n in sorted(set(args.e2e_decode_batches)):
        guarded(rows, "e2e decode", f"{n} seqs x ctx {args.e2e_context}, {args.e2e_layers}L",
                lambda n=n: need_model().decode(n))
    guarded(rows, "e2e prefill", f"{args.e2e_prefill}-token prompt, {args.e2e_layers}L",
            lambda: need_model().prefill())
    model.clear()  # the weights and the KV cache go before anything runs after this section
