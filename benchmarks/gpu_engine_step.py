"""Section 5 of the GPU script (`gpu_kernels.py --sections e2e`, `--e2e-*` knobs; its rows in order:
`gpu_engine_section.py`): a random model of
Llama-3-8B's shape (hidden 4096, 32/8 heads x 128, intermediate 14336, vocab 128256, rope theta 500000, untied
head; `--e2e-layers N` fewer layers) in bf16, built by the engine's own path (`build_from_module` + `Engine`,
the platform's default attention: the Triton kernel on GPU, forced to the same kernel in interpret mode on CPU).

1. Check first (`e2e_check`): greedy tokens of that kernel equal those of attention_backend="reference" over a
   few hand-built ragged steps of a 2-layer model with the same heads (float32 and bf16; teacher-forced, flips
   allowed only at near-ties of the reference's own logits, logits within a relative tolerance).
2. Build (`E2EModel`): the full-size random model, sharded onto the mesh, and its engine warmed up (every step
   program compiled), unless --time-budget has less than `build_reserve_s` left.
3. Idle steps (`idle_steps`): each bucket's program with no sequences (no KV read), one call at a time
   from dispatch to samples on the host: the weights-and-sampler floor of a step, per token bucket.
   Decode (`E2EModel.decode`) at 1, 16 and 64 running sequences, each with 1024 tokens of context prefilled
   through the engine: windows of 64 back-to-back `Engine.step()` calls (host work and asynchronous scheduling
   included; the device is waited for only around each window), median of 3. Reports ms/step, tokens/s, and
   GB/s = the least bytes a step must move (the measured model's parameter bytes, embedding table excluded,
   + the K/V bytes of every sequence's context read + its new tokens' K/V written) over step time; ratio =
   that over the copy GB/s of the same run (`gpu_common.COPY`, measured here if the decode section did not),
   issue 52's measure. Every figure is of the model actually built: with --e2e-layers 8 it is a quarter of
   the layers' bytes, not an extrapolation to 32.
4. Prefill (`E2EModel.prefill`): one 2048-token prompt on the idle engine (one step), tokens/s and useful
   TFLOP/s.
5. Quantized variants (issue 27): `--e2e-quantization int8|fp8` (linear layers quantized at load; on a GPU
   int8 runs weight-only by default, bf16 activations and the codes converted inside the product, fp8
   dynamic fp8 on the fp8 tensor cores; `--e2e-quantization-strategy` names another) and
   `--e2e-kv-cache-dtype int8|fp8`; the byte counts are the engine's own (`Engine.precision`: codes, scales,
   4-bit at half a byte). `--e2e-quantized-matmul xla|pallas` forces the weight-only products to XLA's or
   to the Pallas kernels (issue 52; the default, auto, times both per shape at start).
6. Layer loops (issue 28): `--e2e-layer-loop unroll|scan` (auto: unrolled on a GPU); the build+compile row
   is where the scan's compile time shows, the decode rows whether the scanned weights slow a step.
7. Where a decode step's time goes: after its timed windows, the decode row of --e2e-profile-batches runs
   --e2e-profile-steps more steps under `jax.profiler`, and the trace's events are summed per process and
   name (`gpu_common.profile_summary`): on a GPU, the device's busiest kernels per step, its busy time
   against the wall time, and the least bytes over the busy time as a fraction of the copy's speed
   (`gpu_common.device_share`: whether the kernels or the host's gaps hold the step).
8. Split keys: `--e2e-kv-splits N` builds the step programs with the Triton kernel's num_kv_splits=N (at
   most N: a sequence splits only into shares of at least 1024 keys); 1 turns the default split-K off.
9. Mixtures of experts (issue 29): `--e2e-experts E` builds a Qwen3-MoE-shaped model (QK-norm, every layer
   routed, `--e2e-experts-per-token`, `--e2e-moe-intermediate`), whose grouped expert products run
   `jax.lax.ragged_dot` on a GPU; its GB/s count the weights of the experts a step is expected to reach.
   The session script's moe8 / dense8a parts are Qwen3-30B-A3B's shape at 8 layers and a dense model of its
   active size, the issue's step-cost comparison.
10. Speculation (issue 26): `--e2e-ngram K` runs the engine with n-gram drafts of up to K tokens; the
   decode rows' tok/s count the tokens made, drafts kept included (a random model's greedy output loops,
   which flatters n-gram drafts: the row shows the mechanics' cost and gain on the device, not a
   workload's). `drafts_per_step` is the drafts each sequence verified a step in the row's window: near K,
   its steps are (K+1)-token verify steps, whose time against a plain decode step's is issue 52's target.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import gpu_common

CHECK_TOLERANCES = {  # logits rel. error, and the reference's top-2 margin (in row std) that excuses a flip
    "float32": (1e-3, 1e-3), "bfloat16": (5e-2, 0.1)}


def build_reserve_s(layers: int) -> float:
    """Seconds --time-budget must still have left to start building the timed model (a guess: ~150 s for
    32 layers, most of it random init through the host and compiling the step programs)."""
    return 40 + 3.5 * layers


def e2e_config(args, num_layers: int, vocab: int, max_len: int, experts: bool = True):
    """Llama's shape, or with --e2e-experts (unless `experts` is False) a Qwen3-MoE one (QK-norm, every
    layer's MLP routed over experts)."""
    from jaxserve.config import ModelConfig
    moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=args.e2e_experts,
               num_experts_per_tok=args.e2e_experts_per_token, moe_intermediate_size=args.e2e_moe_intermediate,
               norm_topk_prob=True, sparse_layers=(True,) * num_layers) if args.e2e_experts and experts else {}
    return ModelConfig(**{"model_type": "llama", **moe}, vocab_size=vocab, hidden_size=args.e2e_hidden,
                       intermediate_size=args.e2e_intermediate, num_layers=num_layers, num_heads=args.e2e_heads,
                       num_kv_heads=args.e2e_kv_heads, head_dim=args.e2e_head_dim, max_position_embeddings=max_len,
                       rope_theta=500000.0, tie_word_embeddings=False, torch_dtype=args.e2e_dtype,
                       bos_token_id=1, eos_token_id=2)


def expert_fraction_read(config, tokens: int) -> float:
    """The expected share of a layer's experts that `tokens` tokens route to (uniform routing, as a random
    model's is nearly): 1 - (1 - k / E) ** tokens. 1 for a dense model."""
    if not config.num_experts:
        return 1.0
    return 1.0 - (1.0 - config.num_experts_per_tok / config.num_experts) ** tokens


def with_kv_splits(attention, splits: int | None):
    """The attention backend with the Triton kernel's num_kv_splits (`--e2e-kv-splits`); as is for None (the
    kernel's default, `ragged_gpu.default_kv_splits`)."""
    if splits is None:
        return attention
    return dataclasses.replace(attention, name=f"{attention.name}, kv_splits={splits}",
                               ragged=functools.partial(attention.ragged, num_kv_splits=splits))


def dry_run_options() -> dict:
    """XLA options of the step programs that hold the kernel: in a CPU dry run they emulate a GPU program
    that no user runs on a CPU, so, like the kernel sections' `interpreted` calls, they are compiled without
    LLVM's optimizations (`INTERPRET_COMPILER_OPTIONS`: a tiny part's two step programs in 7 s, not 10);
    on a device, none."""
    from pallas_kernels.testing import INTERPRET_COMPILER_OPTIONS
    return dict(INTERPRET_COMPILER_OPTIONS) if gpu_common.INTERPRET else {}


def e2e_build(engine_args, config, dtype, seed: int):
    """The engine's own path: a random NNX module, sharded onto the (one-device) mesh by `build_from_module`
    (in a CPU dry run, its step programs compiled with `dry_run_options`)."""
    from jaxserve.engine.builder import build_from_module
    from jaxserve.text.tokenizer import Tokenizer
    from jaxserve.model.registry import random_model
    # Token-id prompts: the byte-level tokenizer only detokenizes the samples (unknown ids decode to "").
    built = build_from_module(engine_args, "random-llama", random_model(config, dtype, seed), config,
                              Tokenizer.byte_level(), dtype)
    return dataclasses.replace(built, compiler_options=built.compiler_options | dry_run_options())


def e2e_backend() -> str:
    """The platform's default ("auto": the Pallas Triton kernel on GPU); a CPU dry run forces the same kernel,
    which runs there in interpret mode."""
    return "pallas" if gpu_common.INTERPRET else "auto"


def e2e_check(args, dtype_name: str, checks: list) -> None:
    """Greedy tokens of the platform's kernel against attention_backend="reference" on a small random model of
    the same head layout: two ModelRunners over one set of weights run the same hand-built ragged steps (whole
    prompts, a prompt split over two steps beside decodes, then decodes), both fed the reference's tokens
    (teacher forcing, so one flip cannot cascade). Passes when the logits agree within the dtype's tolerance
    and every sampled token is equal, except flips where the reference's own top-2 margin is within rounding
    (a random model's logits are flat; a broken kernel moves them by far more)."""
    import contextlib
    from jaxserve.engine_args import EngineArgs
    from jaxserve.scheduling.pages import pages_needed
    from jaxserve.execution.runner import ModelRunner
    from jaxserve.scheduling.step import ScheduledSeq, StepPlan
    from pallas_kernels.dispatch import select_attention_backend

    dtype = jnp.dtype(dtype_name)
    rel_tol, tie_tol = CHECK_TOLERANCES[dtype_name]
    lens, steps, page = list(args.e2e_check_prompts), args.e2e_check_steps, args.e2e_page_size
    n = len(lens)
    max_len = page * pages_needed(max(lens) + steps + 1, page)
    bucket = 1 << (sum(lens) - 1).bit_length()  # holds the first step, the largest
    per_seq = pages_needed(max_len, page)
    engine_args = EngineArgs(max_num_seqs=n, max_model_len=max_len, page_size=page, num_pages=1 + n * per_seq,
                             token_buckets=(bucket,), max_num_batched_tokens=bucket, attention_backend=e2e_backend(),
                             enable_prefix_caching=False)
    vocab = min(args.e2e_vocab, args.e2e_check_vocab)
    # Dense even for --e2e-experts: the check is of the attention kernel, and top-k routing turns a rounding
    # difference into a different expert (a bf16 MoE's logits differ by more than the dtype's tolerance).
    config = e2e_config(args, args.e2e_check_layers, vocab, max_len, experts=False)
    # float32: full-precision matmuls everywhere (no tf32), so the kernel is the only difference left.
    precision = jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()
    with precision:
        built = e2e_build(engine_args, config, dtype, seed=5)
        backends = {"reference": select_attention_backend("reference"),
                    "kernel": with_kv_splits(built.attention, args.e2e_kv_splits)}
        # the reference compiled as always; the kernel's program as the timed engine's (`dry_run_options`)
        runners = {k: ModelRunner(built.model, built.model_config, built.cache_config, built.scheduler_config, b,
                                  built.dtype, compiler_options=dry_run_options() if k == "kernel" else None)
                   for k, b in backends.items()}
        rng = np.random.default_rng(5)
        prompts = [rng.integers(3, vocab, size=k).tolist() for k in lens]
        pages = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(n)]
        fed, last = [0] * n, [0] * n
        compared = equal = ties = 0
        diff2 = ref2 = 0.0
        worst_margin = 0.0
        finite = True
        for step in range(steps):
            spec = []  # (sequence, start, token ids, whether its sample is a real next token)
            for i, prompt in enumerate(prompts):
                if fed[i] < len(prompt):
                    end = len(prompt) // 2 if (i == n - 1 and step == 0) else len(prompt)
                    spec.append((i, fed[i], prompt[fed[i]:end], end == len(prompt)))
                else:
                    spec.append((i, fed[i], [last[i]], True))
            out = {}
            for name, runner in runners.items():
                spans = [ScheduledSeq.for_sequence(i, pages[i], start, ids) for i, start, ids, _ in spec]
                step = runner.run(StepPlan.of(spans))
                out[name] = (step.samples, np.asarray(step.logits[:step.rows[-1].stop], np.float64), step.rows)
            (ref_s, ref_l, rows), (got_s, got_l, _) = out["reference"], out["kernel"]
            finite &= bool(np.isfinite(got_l).all() and np.isfinite(ref_l).all())
            diff2 += float(np.sum((got_l - ref_l) ** 2))
            ref2 += float(np.sum(ref_l ** 2))
            for j, (i, start, ids, real) in enumerate(spec):
                fed[i] = start + len(ids)
                last[i] = int(ref_s[j])
                if not real:
                    continue
                compared += 1
                if got_s[j] == ref_s[j]:
                    equal += 1
                    continue
                row = ref_l[rows[j].stop - 1]
                margin = float(row[ref_s[j]] - row[got_s[j]]) / max(float(row.std()), 1e-30)
                worst_margin = max(worst_margin, margin)
                ties += margin <= tie_tol
        del runners, built
    rel = (diff2 / ref2) ** 0.5 if ref2 else float("nan")
    ok = finite and compared > 0 and rel <= rel_tol and equal + ties == compared
    name = f"e2e greedy {dtype_name} {backends['kernel'].name} vs reference ({args.e2e_check_layers}L)"
    checks.append(dict(check=name, ok=ok, tokens=compared, equal=equal, near_ties=ties, logits_rel_err=rel,
                       rel_tol=rel_tol, worst_flip_margin_std=worst_margin, tie_tol_std=tie_tol, finite=finite))
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {equal}/{compared} greedy tokens equal"
          + (f" ({ties} flips at near-ties, worst margin {worst_margin:.2g} std)" if compared - equal else "")
          + f", logits rel err {rel:.1e} (tol {rel_tol:g})" + ("" if finite else ", NOT finite"), flush=True)


class E2EModel:
    """The timed engine over the full-size random model, with what the rows need to count bytes and FLOPs."""

    def __init__(self, args):
        from jaxserve import Engine, EngineArgs
        from jaxserve.engine.builder import smallest_token_bucket
        from jaxserve.scheduling.pages import pages_needed

        batches = sorted(set(args.e2e_decode_batches))
        budget = max(args.e2e_prefill, batches[-1])
        # Every sequence's context, its tokens decoded while the others prefilled, the timed steps, a margin;
        # and room for the prefill prompt plus its one sampled token.
        decoded = (-(-batches[-1] * args.e2e_context // budget) + 2 + args.e2e_warmup_steps
                   + args.e2e_repeats * args.e2e_steps + 8)
        page = args.e2e_page_size
        max_len = page * pages_needed(max(args.e2e_context + decoded, args.e2e_prefill + 1), page)
        self.args, self.batches = args, batches
        self.dtype = jnp.dtype(args.e2e_dtype)
        self.config = c = e2e_config(args, args.e2e_layers, args.e2e_vocab, max_len)
        # One bucket per decode row, raised to the engine's smallest default bucket for this backend and
        # dtype (a lone bf16 decode on a GPU runs padded to 16) unless --e2e-exact-buckets asks for the rows
        # as given (the A/B of that padding).
        smallest = 1 if args.e2e_exact_buckets else smallest_token_bucket(jax.default_backend(), self.dtype)
        buckets = tuple(sorted({max(b, smallest) for b in batches} | {budget}))
        engine_args = EngineArgs(max_num_seqs=batches[-1], max_model_len=max_len, page_size=page,
                                 max_num_batched_tokens=budget, token_buckets=buckets,
                                 attention_backend=e2e_backend(), quantization=args.e2e_quantization,
                                 quantization_strategy=args.e2e_quantization_strategy,
                                 quantized_matmul=args.e2e_quantized_matmul,
                                 kv_cache_dtype=args.e2e_kv_cache_dtype, layer_loop=args.e2e_layer_loop,
                                 # every draft found is verified (vLLM's way): the part times the verify
                                 # step, which the engine's pricing may rightly not choose on a tiny model
                                 speculative_config=None if not args.e2e_ngram else dict(
                                     method="ngram", num_speculative_tokens=args.e2e_ngram, prompt_lookup_min=2,
                                     prompt_lookup_max=4, adaptive_drafting=False))
        t0 = time.perf_counter()
        built = e2e_build(engine_args, c, self.dtype, seed=0)
        # the kernel with split keys (if asked for) in the step programs the engine compiles
        built = dataclasses.replace(built, attention=with_kv_splits(built.attention, args.e2e_kv_splits))
        jax.block_until_ready(built.model.params)
        self.build_s = time.perf_counter() - t0
        self.engine = Engine(engine_args, built=built)
        self.backend = built.attention.name
        self.warmup_s = self.engine.warmup()
        item = self.dtype.itemsize
        precision = self.engine.precision  # int8 / fp8 weights and pages count their own bytes (scales too)
        self.param_bytes = precision.weight_bytes  # the measured model's, whatever --e2e-layers says
        self.embed_bytes = c.vocab_size * c.hidden_size * item  # gathered, not read whole (untied head)
        elements = sum(a.size for a in jax.tree.leaves(built.model.params))  # codes: one per weight
        # The experts' gate, up and down projections: read only for the experts a step's tokens route to.
        expert_params = c.num_layers * c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size
        self.expert_bytes = expert_params * self.param_bytes / elements  # at the weights' mean bytes per element
        # FLOPs per token: a token runs its top-k experts, not all of them
        active = expert_params * c.num_experts_per_tok / c.num_experts if c.num_experts else 0
        self.layer_params = elements - 2 * c.vocab_size * c.hidden_size - c.hidden_size - expert_params + active
        self.kv_bytes_per_token = precision.kv_token_bytes
        self.kv_cache_bytes = self.engine.runner.kv_cache.num_bytes
        self.rng = np.random.default_rng(1)

    def prompt(self, length: int) -> list[int]:
        """Random tokens; with --e2e-ngram a random 16-token phrase repeated, so the lookup has n-grams to
        draft from (whether the drafts stand is the random model's business)."""
        if not self.args.e2e_ngram:
            return self.rng.integers(3, self.config.vocab_size, size=length).tolist()
        phrase = self.rng.integers(3, self.config.vocab_size, size=16).tolist()
        return (phrase * -(-length // 16))[:length]

    def drain(self, limit: int = 100_000) -> None:
        for _ in range(limit):
            if not self.engine.has_unfinished():
                return
            self.engine.step()
        raise RuntimeError("the engine did not drain")

    def decode(self, n: int) -> dict:
        """n sequences with a context of --e2e-context each, prefilled through the engine; then windows of
        --e2e-steps back-to-back `Engine.step()` calls (host work and asynchronous scheduling included), the
        device waited for only before and after each window. The median window gives the row."""
        from jaxserve import SamplingParams
        a, engine = self.args, self.engine
        params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        ids = {engine.add_request(self.prompt(a.e2e_context), params) for _ in range(n)}
        try:
            started = set()
            for _ in range(n * a.e2e_context + 100):  # prefill: every sequence reaches its first token
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
                if ids <= started:
                    break
            else:
                raise RuntimeError(f"only {len(started)} of {n} sequences reached decode")
            for _ in range(a.e2e_warmup_steps):
                engine.step()
            prompt_tokens, compiles = engine.stats.prompt_tokens, engine.compilations_since_warmup
            windows = []
            for _ in range(a.e2e_repeats):
                running = engine.scheduler.running
                # Past its prompt, not `is_decoding`: with --e2e-ngram a step verifying drafts may be in flight,
                # its tokens counted as computed before the host knows how many stand.
                if len(running) != n or not all(r.num_computed >= r.num_prompt_tokens for r in running):
                    raise RuntimeError(f"{len(running)} sequences running, not {n} past their prompts")
                kv_first = sum(r.num_computed + 1 for r in running)  # the next step's kv_lens, summed
                jax.block_until_ready(engine.runner.kv_cache)
                made, drafted = engine.stats.generation_tokens, engine.stats.spec_draft_tokens
                t0 = time.perf_counter()
                for _ in range(a.e2e_steps):
                    engine.step()
                jax.block_until_ready(engine.runner.kv_cache)
                t = (time.perf_counter() - t0) / a.e2e_steps
                made = (engine.stats.generation_tokens - made) / a.e2e_steps  # n, or more with drafts kept
                drafted = (engine.stats.spec_draft_tokens - drafted) / a.e2e_steps / n  # per sequence a step
                # the mean KV tokens read, and the drafts each sequence verified a step
                windows.append((t, kv_first + made * (a.e2e_steps - 1) / 2, made, drafted))
            profile = None
            if n in a.e2e_profile_batches:  # after the timed windows, so the profiler cannot slow them
                def wait():  # the cache each step leaves (the old one is donated to the next step)
                    jax.block_until_ready(engine.runner.kv_cache)

                wait()
                profile = gpu_common.profile_summary(engine.step, a.e2e_profile_steps, wait=wait)
                gpu_common.print_profile(f"decode {n} seqs", profile)
            if engine.stats.prompt_tokens != prompt_tokens:
                raise RuntimeError("a prefill ran inside the timed steps (a preemption?): not pure decode")
        finally:
            for request_id in ids:
                engine.abort(request_id)
            self.drain()
        t, kv_tokens, made, drafted = sorted(windows)[len(windows) // 2]
        # The least a step must move (program_profile.py's minimum): the weights once (the embedding rows it
        # gathers, the experts its tokens reach), every sequence's KV read, and the KV of its new tokens written.
        params_read = (self.param_bytes - self.embed_bytes + n * self.config.hidden_size * self.dtype.itemsize
                       - self.expert_bytes * (1 - expert_fraction_read(self.config, n)))
        kv_read = kv_tokens * self.kv_bytes_per_token
        kv_written = n * (1 + drafted) * self.kv_bytes_per_token
        min_bytes = params_read + kv_read + kv_written
        gbs = min_bytes / t / 1e9
        copy_gbs = gpu_common.COPY.get("gbs", float("nan"))
        row = dict(ms=t * 1e3, tok_s=made / t, tokens_per_step=made, gbs=gbs, ratio=gbs / copy_gbs, seqs=n,
                   mean_context=kv_tokens / n, param_bytes_read=params_read, kv_bytes_read=kv_read,
                   kv_bytes_written=kv_written, min_bytes=min_bytes,
                   steps_per_window=a.e2e_steps, window_ms=[w[0] * 1e3 for w in windows],
                   compiles_while_timed=engine.compilations_since_warmup - compiles,
                   token_bucket=engine.runner.compiler.layout_for(n).tokens,  # the program of a plain step
                   **(dict(drafts=engine.stats.spec_draft_tokens, drafts_kept=engine.stats.spec_accepted_tokens,
                           drafts_per_step=drafted) if a.e2e_ngram else {}),  # the first two: the engine's life
                   **(gpu_common.device_share(profile, min_bytes, copy_gbs) if profile else {}))
        per_sequence = (f" ({made / n:.2f} tokens a sequence a step, {drafted:.2f} drafts verified)"
                        if a.e2e_ngram else "")
        print(f"  decode {n} seqs (context ~{kv_tokens / n:.0f}, {row['token_bucket']}-token step): "
              f"{t * 1e3:.2f} ms/step, {made / t:.0f} tok/s{per_sequence}, "
              f"{gbs:.0f} GB/s of its least bytes ({row['ratio']:.2f} of copy)", flush=True)
        return row

    def prefill(self) -> dict:
        """One --e2e-prefill-token prompt on the idle engine: submission to first token, i.e. one step of that
        many tokens plus the host work around it. Median of --e2e-repeats after an untimed one."""
        from jaxserve import SamplingParams
        a, engine, c = self.args, self.engine, self.config
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        times = []
        for i in range(1 + a.e2e_repeats):
            prompt, before = self.prompt(a.e2e_prefill), engine.stats.prompt_tokens
            t0 = time.perf_counter()
            request_id = engine.add_request(prompt, params)
            for steps in range(1, 10):
                if any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
                    break
            t = time.perf_counter() - t0
            self.drain()
            if engine.stats.prompt_tokens - before != a.e2e_prefill or steps != 2:
                raise RuntimeError(f"expected one {a.e2e_prefill}-token step, got {steps - 1} steps and "
                                   f"{engine.stats.prompt_tokens - before} prefilled tokens")
            if i:
                times.append(t)
        t, tokens = float(np.median(times)), a.e2e_prefill
        # Useful FLOPs: every layer's matmuls on every token, causal attention, the LM head on the last token.
        flops = (2 * tokens * self.layer_params + 2 * c.vocab_size * c.hidden_size
                 + 4 * c.num_layers * c.num_heads * c.head_dim * tokens * (tokens + 1) / 2)
        print(f"  prefill {tokens} tokens: {t * 1e3:.1f} ms, {tokens / t:.0f} tok/s, {flops / t / 1e12:.1f} TFLOP/s",
              flush=True)
        return dict(ms=t * 1e3, tok_s=tokens / t, tflops=flops / t / 1e12, times_ms=[x * 1e3 for x in times])

