"""Check and time the Pallas Triton ragged paged-attention kernel on a GPU, beside the pure-jnp reference, and
the engine end to end on a random Llama-3-8B-shaped model.

Run from the repository root on the GPU machine (installs nothing; not yet timed on an H200, expected about
4-6 minutes in all, most of it compilation: see "Time" below):

    python3 benchmarks/gpu_kernels.py --time-budget 390     # device call timeout 480 s; writes $OUT/gpu_kernels.json
    python3 benchmarks/gpu_kernels.py --interpret --batch 2 --context 64 --chunk 32 --mixed-decodes 2 \\
        --mixed-chunk 16 --page-sizes 16 --block-tokens 16 --prefill-blocks 8x16 --e2e-tiny   # CPU dry run
    python3 benchmarks/gpu_kernels.py --interpret --skip-checks --sections e2e --e2e-tiny   # e2e only (~20 s)

1. Correctness: the kernel against `ragged_paged_attention_reference`, float32 and bfloat16, on shuffled pages
   with ragged mixes (decodes, first prefill chunks, chunks over a cached prefix, padding sequences and
   padding rows, lengths 1 and page boundaries), plain and with soft_cap + sliding_window.
2. Decode: batch 64 x context 2048 (one row per sequence), 32 query / 8 KV heads, head_dim 128, bf16, page
   sizes 16/32/64 and a few key-block sizes. Reports HBM GB/s (K/V bytes the kernel reads + q + out, over
   time) and its ratio to a device-to-device copy of a buffer the size of K+V measured in the same run
   (copy GB/s = read + write).
3. Prefill: one 2048-token first chunk (causal) with the same heads; TFLOP/s = 4 * D * H * T(T+1)/2 / time.
4. Mixed: 60 decodes plus one 512-token chunk over a 512-token cached prefix in one ragged call, against the
   same decodes and the same chunk as two separate calls (the unified kernel should cost about their sum).
5. End to end (`--sections e2e`; `--e2e-*` knobs): a random model of Llama-3-8B's shape (hidden 4096, 32/8
   heads x 128, intermediate 14336, vocab 128256, rope theta 500000, untied head; `--e2e-layers N` fewer
   layers) in bf16, built by the engine's own path (`build_from_module` + `Engine`, the platform's default
   attention: the Triton kernel on GPU, forced to the same kernel in interpret mode on CPU).
   a. Check first: greedy tokens of that kernel equal those of attention_backend="reference" over a few
      hand-built ragged steps of a 2-layer model with the same heads (float32 and bf16; teacher-forced, flips
      allowed only at near-ties of the reference's own logits, logits within a relative tolerance).
   b. Decode at 1, 16 and 64 running sequences, each with 1024 tokens of context prefilled through the
      engine: windows of 64 back-to-back `Engine.step()` calls (host work and asynchronous scheduling
      included; the device is waited for only around each window), median of 3. Reports ms/step, tokens/s,
      and GB/s = (the measured model's parameter bytes, embedding table excluded, + the K/V bytes of every
      sequence's context) per step, over step time; ratio = that over the copy GB/s of the same run. Every
      figure is of the model actually built: with --e2e-layers 8 it is a quarter of the layers' bytes, not
      an extrapolation to 32.
   c. Prefill: one 2048-token prompt on the idle engine (one step), tokens/s and useful TFLOP/s.
Timings: warm-up, then the median over repeats of back-to-back calls (block_until_ready at the end of each).
Every section and part records its errors and goes on, so one broken configuration never hides the others'
numbers; the JSON under $OUT is rewritten after each section, so a run cut short still leaves what it got.

Time (an estimate until a run records it in the JSON's section_seconds): kernel sections about 2 minutes of
Triton compiles; e2e: the check ~30-45 s, the 8B model's random init + sharding (~16 GB of weights through
the host) ~20-30 s, warm-up compiling 4 step programs of 32 unrolled layers (token buckets 1, 16, 64, 2048)
~1-2.5 minutes, the timed steps ~15 s. Memory: ~16 GB of weights (32 GB while sharding) + a 17 GB KV cache.
`--time-budget S` turns every part not started by S seconds into a "skipped" error row (the 8B model needs
BUILD_RESERVE_S left), so the table is printed before the device call's timeout; if time is short, rerun
with `--sections e2e --skip-checks`, or `--e2e-layers 8` (fewer unrolled layers to compile).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import ragged_gpu  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.testing import TOLERANCES, random_ragged_case  # noqa: E402

INTERPRET = False  # --interpret: a CPU dry run of this script's logic (use tiny sizes)
TIMING = dict(warmup=3, calls=20, repeats=5)  # --interpret: one call each, only to exercise the code
H, KVH, D = 32, 8, 128  # the timed shapes: a Llama-3-8B-like layer
DTYPE = jnp.bfloat16
COPY: dict = {}  # {"gbs": copy bandwidth} once a section measured it (the decode section, or e2e itself)
BUDGET = dict(start=time.perf_counter(), seconds=float("inf"))  # --time-budget: later parts are skipped


def kernel(*args, **kwargs):
    return ragged_gpu.ragged_paged_attention_gpu(*args, interpret=INTERPRET, **kwargs)


def bench(fn, *args, calls: int | None = None) -> float:
    """Median seconds per call over `repeats` runs of `calls` back-to-back calls."""
    calls = min(calls or TIMING["calls"], TIMING["calls"])
    for _ in range(TIMING["warmup"]):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(TIMING["repeats"]):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def check_budget(reserve: float = 0.0) -> None:
    """Raise once the run is past --time-budget (or would be, for a part expected to take `reserve` seconds):
    the parts not started yet become error rows, and the table and JSON still get written before the device
    call's timeout."""
    elapsed = time.perf_counter() - BUDGET["start"]
    if elapsed + reserve > BUDGET["seconds"]:
        raise TimeoutError(f"skipped: {elapsed:.0f} s in" + (f", needs ~{reserve:.0f} s more" if reserve else "")
                           + f", past --time-budget {BUDGET['seconds']:.0f} s")


def guarded(rows: list, bench_name: str, config: str, measure) -> None:
    """Run `measure() -> dict` into a row; an exception becomes an error row (and a traceback on stderr)."""
    try:
        check_budget()
        rows.append(dict(bench=bench_name, config=config, **measure()))
    except Exception as e:  # keep going: one broken configuration must not hide the others' numbers
        rows.append(dict(bench=bench_name, config=config, error=f"{type(e).__name__}: {e}"[:2000]))
        if not isinstance(e, TimeoutError):
            traceback.print_exc()


# ---- 1. correctness ---------------------------------------------------------------------------------------

def check_setups(small: bool) -> list[dict]:
    """Ragged batches as (q_len, kv_len) per sequence; `small` (interpret mode) shrinks every length."""
    n = (lambda x: max(1, x // 16) if x > 1 else x) if small else (lambda x: x)
    mix = lambda seqs: [(n(q), n(k)) for q, k in seqs]
    return [
        dict(name="mixed G4 D128 S16", kvh=8, group=4, d=128, s=16, padding=5, opts={},
             seqs=mix([(1, 1), (1, 16), (0, 0), (1, 1000), (256, 550), (37, 37), (1, 511), (0, 300)])),
        dict(name="decode G1 D64 S32 cap+win", kvh=4, group=1, d=64, s=32, padding=2,
             opts=dict(soft_cap=20.0, sliding_window=100),
             seqs=mix([(1, 1), (1, 32), (1, 33), (1, 300), (0, 0), (1, 129)])),
        dict(name="mixed G8 D128 S64 cap+win", kvh=2, group=8, d=128, s=64, padding=0,
             opts=dict(soft_cap=30.0, sliding_window=64),
             seqs=mix([(200, 200), (1, 64), (64, 320), (1, 65)])),
    ]


def run_checks(results: list) -> None:
    rng = np.random.default_rng(0)
    for setup in check_setups(INTERPRET):
        q_lens, kv_lens = zip(*setup["seqs"])
        max_pages = max(1, -(-max(kv_lens) // setup["s"]))
        case = random_ragged_case(rng, list(q_lens), list(kv_lens), num_kv_heads=setup["kvh"], group=setup["group"],
                                  page_size=setup["s"], head_dim=setup["d"], max_pages=max_pages,
                                  padding_tokens=setup["padding"])
        for dtype in ("float32", "bfloat16"):
            name = f"ragged {dtype} {setup['name']}"
            try:
                args = (jnp.asarray(case.q, dtype), jnp.asarray(case.paged.k_pages, dtype),
                        jnp.asarray(case.paged.v_pages, dtype), jnp.asarray(case.kv_lens),
                        jnp.asarray(case.paged.page_tables), jnp.asarray(case.cu_q_lens))
                scale = setup["d"] ** -0.5
                got = kernel(*args, sm_scale=scale, **setup["opts"])
                with jax.default_matmul_precision("highest"):
                    want = ragged_paged_attention_reference(*args, sm_scale=scale, **setup["opts"])
                padding_zero = not np.asarray(got[int(case.cu_q_lens[-1]):], np.float32).any()
                record_check(results, name, got, want, dtype, padding_zero)
            except Exception as e:  # keep going: one broken case must not hide the others' results
                results.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()


def record_check(results, name, got, want, dtype, padding_zero: bool) -> None:
    atol, rtol = TOLERANCES[dtype]
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ok = bool(np.all(np.abs(g - w) <= atol + rtol * np.abs(w))) and bool(np.isfinite(g).all()) and padding_zero
    err = float(np.max(np.abs(g - w))) if g.size else 0.0
    results.append(dict(check=name, ok=ok, max_abs_err=err, atol=atol, rtol=rtol, padding_zero=padding_zero))
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |err| {err:.2e}"
          + ("" if padding_zero else ", padding rows NOT zero"), flush=True)


# ---- shared setup of the timed sections -------------------------------------------------------------------

def ragged_batch(seqs: list[tuple[int, int]], page_size: int, seed: int):
    """Device arrays of a ragged step over a random paged cache: sequence s has kv_len cached tokens, the
    last q_len of them new; pages are a random permutation of the pool (page 0 stays the null page)."""
    q_lens, kv_lens = map(list, zip(*seqs))
    max_pages = max(1, max(-(-k // page_size) for k in kv_lens))
    num_pages = 1 + len(seqs) * max_pages
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (KVH, num_pages, page_size, D)
    k_pages, v_pages = jax.random.normal(keys[0], shape, DTYPE), jax.random.normal(keys[1], shape, DTYPE)
    tables = jax.random.permutation(keys[2], jnp.arange(1, num_pages, dtype=jnp.int32)).reshape(len(seqs), -1)
    q = jax.random.normal(keys[3], (sum(q_lens), H, D), DTYPE)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32), tables, cu_q_lens


def measure_copy(nbytes: int) -> dict:
    """Device-to-device copy of an `nbytes` buffer (read + write counted): the bandwidth yardstick, kept in COPY
    for every later section of the run."""
    buf = jnp.ones((nbytes // jnp.dtype(DTYPE).itemsize,), DTYPE)
    t = bench(jax.jit(jnp.copy), buf)
    COPY["gbs"] = 2 * nbytes / t / 1e9
    print(f"  copy: {COPY['gbs']:.0f} GB/s", flush=True)
    return dict(ms=t * 1e3, gbs=COPY["gbs"], ratio=1.0)


def timed_kernel(args, **opts):
    fn = jax.jit(lambda *a: kernel(*a, sm_scale=D ** -0.5, **opts))
    return bench(fn, *args)


# ---- 2. decode bandwidth ----------------------------------------------------------------------------------

def run_decode(args, rows: list) -> None:
    b, ctx = args.batch, args.context
    itemsize = jnp.dtype(DTYPE).itemsize
    kv_bytes = 2 * b * KVH * ctx * D * itemsize
    qo_bytes = 2 * b * H * D * itemsize

    # The yardstick: a device-to-device copy of a buffer the size of K+V (reads and writes it once each).
    guarded(rows, "copy (K+V bytes)", f"{kv_bytes / 2**20:.0f} MiB", lambda: measure_copy(kv_bytes))
    copy_gbs = COPY.get("gbs", float("nan"))

    for page_size in args.page_sizes:
        batch = ragged_batch([(1, ctx)] * b, page_size, seed=page_size)
        for block_tokens in args.block_tokens:
            ppb = max(1, block_tokens // page_size)
            if ppb * page_size < 16:
                continue
            block = ppb * page_size

            def measure(ppb=ppb, block=block):
                t = timed_kernel(batch, pages_per_compute_block=ppb)
                read = 2 * b * KVH * (-(-ctx // block) * block) * D * itemsize + qo_bytes
                gbs = read / t / 1e9
                print(f"  decode pages={page_size} block={block}: {t * 1e3:.3f} ms, {gbs:.0f} GB/s "
                      f"({gbs / copy_gbs:.2f} of copy)", flush=True)
                return dict(ms=t * 1e3, gbs=gbs, ratio=gbs / copy_gbs)

            guarded(rows, "decode kernel", f"pages={page_size} block={block}", measure)

        def reference(batch=batch):
            fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=D ** -0.5))
            t = bench(fn, *batch, calls=5)
            gbs = (kv_bytes + qo_bytes) / t / 1e9
            print(f"  decode reference pages={page_size}: {t * 1e3:.3f} ms", flush=True)
            return dict(ms=t * 1e3, gbs=gbs, ratio=gbs / copy_gbs)

        guarded(rows, "decode reference", f"pages={page_size}", reference)
        del batch


# ---- 3. prefill FLOP/s -------------------------------------------------------------------------------------

def run_prefill(args, rows: list) -> None:
    t_len, page_size = args.chunk, 16
    batch = ragged_batch([(t_len, t_len)], page_size, seed=7)
    flops = 4 * D * H * t_len * (t_len + 1) / 2
    configs = [("default", {})] + [
        (f"block_q={bq} keys={bk}", dict(block_q=bq, pages_per_compute_block=max(1, bk // page_size)))
        for bq, bk in args.prefill_blocks]
    for name, opts in configs:
        def measure(opts=opts, name=name):
            t = timed_kernel(batch, **opts)
            print(f"  prefill {name}: {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s", flush=True)
            return dict(ms=t * 1e3, tflops=flops / t / 1e12)

        guarded(rows, "prefill kernel", name, measure)

    def reference():
        fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=D ** -0.5))
        t = bench(fn, *batch, calls=2)
        return dict(ms=t * 1e3, tflops=flops / t / 1e12)

    guarded(rows, "prefill reference", "", reference)


# ---- 4. mixed batch ----------------------------------------------------------------------------------------

def run_mixed(args, rows: list) -> None:
    """One ragged call of decodes + a chunk, against the two parts as separate calls (same cache, so the same
    bytes and FLOPs); ratio = mixed / (decodes + chunk), ~1 when mixing costs nothing."""
    page_size, ctx, chunk, prefix = 16, args.context, args.mixed_chunk, args.mixed_prefix
    decodes = [(1, ctx)] * args.mixed_decodes
    mixed = ragged_batch(decodes + [(chunk, prefix + chunk)], page_size, seed=11)
    q, k_pages, v_pages, kv_lens, tables, cu_q_lens = mixed
    n = len(decodes)
    only_decodes = (q[:n], k_pages, v_pages, kv_lens[:n], tables[:n], cu_q_lens[:n + 1])
    only_chunk = (q[n:], k_pages, v_pages, kv_lens[n:], tables[n:], cu_q_lens[n:] - n)
    config = f"{n} decodes x {ctx} + chunk {chunk} over {prefix}"
    times = {}

    def part(name, batch):
        def measure():
            times[name] = timed_kernel(batch)
            print(f"  {name}: {times[name] * 1e3:.3f} ms", flush=True)
            extra = {}
            if name == "mixed" and {"decodes only", "chunk only"} <= times.keys():
                extra["ratio"] = times["mixed"] / (times["decodes only"] + times["chunk only"])
                print(f"  mixed / (decodes + chunk) = {extra['ratio']:.2f}", flush=True)
            return dict(ms=times[name] * 1e3, **extra)
        return measure

    guarded(rows, "mixed: decodes only", config, part("decodes only", only_decodes))
    guarded(rows, "mixed: chunk only", config, part("chunk only", only_chunk))
    guarded(rows, "mixed: one call", config, part("mixed", mixed))


# ---- 5. end to end: a random Llama-3-8B-shaped model through the engine -------------------------------------

E2E_TINY = dict(e2e_layers=2, e2e_hidden=64, e2e_heads=4, e2e_kv_heads=2, e2e_head_dim=16, e2e_intermediate=128,
                e2e_vocab=512, e2e_context=24, e2e_decode_batches=[1, 2], e2e_prefill=32, e2e_steps=3,
                e2e_repeats=1, e2e_warmup_steps=1, e2e_check_layers=2, e2e_check_prompts=[13, 5, 21],
                e2e_check_steps=3, e2e_copy_mib=8)
BUILD_RESERVE_S = 150  # seconds --time-budget must still have left to start the full-size model (a guess)
CHECK_TOLERANCES = {  # logits rel. error, and the reference's top-2 margin (in row std) that excuses a flip
    "float32": (1e-3, 1e-3), "bfloat16": (5e-2, 0.1)}


def e2e_config(args, num_layers: int, vocab: int, max_len: int):
    from jaxserve.config import ModelConfig
    return ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=args.e2e_hidden,
                       intermediate_size=args.e2e_intermediate, num_layers=num_layers, num_heads=args.e2e_heads,
                       num_kv_heads=args.e2e_kv_heads, head_dim=args.e2e_head_dim, max_position_embeddings=max_len,
                       rope_theta=500000.0, tie_word_embeddings=False, torch_dtype=args.e2e_dtype,
                       bos_token_id=1, eos_token_id=2)


def e2e_build(engine_args, config, dtype, seed: int):
    """The engine's own path: a random NNX module, sharded onto the (one-device) mesh by `build_from_module`."""
    from jaxserve.engine_args import build_from_module
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import random_model
    # Token-id prompts: the byte-level tokenizer only detokenizes the samples (unknown ids decode to "").
    return build_from_module(engine_args, "random-llama", random_model(config, dtype, seed), config,
                             Tokenizer.byte_level(), dtype)


def e2e_backend() -> str:
    """The platform's default ("auto": the Pallas Triton kernel on GPU); a CPU dry run forces the same kernel,
    which runs there in interpret mode."""
    return "pallas" if INTERPRET else "auto"


def e2e_check(args, dtype_name: str, checks: list) -> None:
    """Greedy tokens of the platform's kernel against attention_backend="reference" on a small random model of
    the same head layout: two ModelRunners over one set of weights run the same hand-built ragged steps (whole
    prompts, a prompt split over two steps beside decodes, then decodes), both fed the reference's tokens
    (teacher forcing, so one flip cannot cascade). Passes when the logits agree within the dtype's tolerance
    and every sampled token is equal, except flips where the reference's own top-2 margin is within rounding
    (a random model's logits are flat; a broken kernel moves them by far more)."""
    import contextlib
    from jaxserve.engine_args import EngineArgs
    from jaxserve.kv_cache import pages_needed
    from jaxserve.runner import ModelRunner
    from jaxserve.scheduler import ScheduledChunk
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
    config = e2e_config(args, args.e2e_check_layers, vocab, max_len)
    # float32: full-precision matmuls everywhere (no tf32), so the kernel is the only difference left.
    precision = jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()
    with precision:
        built = e2e_build(engine_args, config, dtype, seed=5)
        backends = {"reference": select_attention_backend("reference"), "kernel": built.attention}
        runners = {k: ModelRunner(built.model, built.model_config, built.cache_config, built.scheduler_config, b,
                                  built.dtype) for k, b in backends.items()}
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
                chunks = [ScheduledChunk.for_sequence(i, pages[i], start, ids) for i, start, ids, _ in spec]
                samples, logits, rows = runner.run(chunks)
                out[name] = (samples, np.asarray(logits[:rows[-1].stop], np.float64), rows)
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
        from jaxserve.kv_cache import pages_needed

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
        engine_args = EngineArgs(max_num_seqs=batches[-1], max_model_len=max_len, page_size=page,
                                 max_num_batched_tokens=budget, token_buckets=tuple(sorted(set(batches) | {budget})),
                                 attention_backend=e2e_backend())
        t0 = time.perf_counter()
        built = e2e_build(engine_args, c, self.dtype, seed=0)
        jax.block_until_ready(built.model.params)
        self.build_s = time.perf_counter() - t0
        self.engine = Engine(engine_args, built=built)
        self.backend = built.attention.name
        self.warmup_s = self.engine.warmup()
        item = self.dtype.itemsize
        self.param_bytes = built.model.num_bytes  # the measured model's, whatever --e2e-layers says
        self.embed_bytes = c.vocab_size * c.hidden_size * item  # gathered, not read whole (untied head)
        self.layer_params = self.param_bytes // item - 2 * c.vocab_size * c.hidden_size - c.hidden_size
        self.kv_bytes_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * item
        self.kv_cache_bytes = self.engine.runner.kv_cache.num_bytes
        self.rng = np.random.default_rng(1)

    def prompt(self, length: int) -> list[int]:
        return self.rng.integers(3, self.config.vocab_size, size=length).tolist()

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
                if len(running) != n or not all(r.is_decoding for r in running):
                    raise RuntimeError(f"{len(running)} sequences running, not {n} decoding")
                kv_first = sum(r.num_computed + 1 for r in running)  # the next step's kv_lens, summed
                jax.block_until_ready(engine.runner.kv_cache)
                t0 = time.perf_counter()
                for _ in range(a.e2e_steps):
                    engine.step()
                jax.block_until_ready(engine.runner.kv_cache)
                t = (time.perf_counter() - t0) / a.e2e_steps
                windows.append((t, kv_first + n * (a.e2e_steps - 1) / 2))  # mean KV tokens read per step
            if engine.stats.prompt_tokens != prompt_tokens:
                raise RuntimeError("a prefill ran inside the timed steps (a preemption?): not pure decode")
        finally:
            for request_id in ids:
                engine.abort(request_id)
            self.drain()
        t, kv_tokens = sorted(windows)[len(windows) // 2]
        params_read = self.param_bytes - self.embed_bytes + n * self.config.hidden_size * self.dtype.itemsize
        kv_read = kv_tokens * self.kv_bytes_per_token
        gbs = (params_read + kv_read) / t / 1e9
        copy_gbs = COPY.get("gbs", float("nan"))
        row = dict(ms=t * 1e3, tok_s=n / t, gbs=gbs, ratio=gbs / copy_gbs, seqs=n, mean_context=kv_tokens / n,
                   param_bytes_read=params_read, kv_bytes_read=kv_read, steps_per_window=a.e2e_steps,
                   window_ms=[w[0] * 1e3 for w in windows],
                   compiles_while_timed=engine.compilations_since_warmup - compiles)
        print(f"  decode {n} seqs (context ~{kv_tokens / n:.0f}): {t * 1e3:.2f} ms/step, {n / t:.0f} tok/s, "
              f"{gbs:.0f} GB/s of weights + KV ({row['ratio']:.2f} of copy)", flush=True)
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

    if "gbs" not in COPY:  # the decode section did not run (or failed): measure the yardstick here
        nbytes = args.e2e_copy_mib << 20
        guarded(rows, "copy", f"{args.e2e_copy_mib} MiB", lambda: measure_copy(nbytes))

    model: dict = {}

    def build():
        check_budget(reserve=0 if INTERPRET else BUILD_RESERVE_S)
        m = model["m"] = E2EModel(args)
        c = m.config
        print(f"  model: random Llama, hidden {c.hidden_size}, {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
              f"heads x {c.head_dim}, intermediate {c.intermediate_size}, vocab {c.vocab_size}: "
              f"{m.param_bytes / m.dtype.itemsize / 1e9:.2f}B parameters = {m.param_bytes / 1e9:.2f} GB "
              f"{m.dtype.name}; KV cache {m.kv_cache_bytes / 1e9:.2f} GB; attention {m.backend}; built in "
              f"{m.build_s:.1f} s, {len(m.engine.runner.layouts)} step programs compiled in {m.warmup_s:.1f} s",
              flush=True)
        return dict(ms=(m.build_s + m.warmup_s) * 1e3, param_bytes=m.param_bytes, kv_cache_bytes=m.kv_cache_bytes,
                    layers=c.num_layers, backend=m.backend, build_s=m.build_s, warmup_s=m.warmup_s,
                    max_model_len=c.max_position_embeddings, buckets=list(m.engine.runner.layouts))

    guarded(rows, "e2e model", f"{args.e2e_layers}L {args.e2e_dtype} build+compile", build)

    def need_model():
        if "m" not in model:
            raise RuntimeError("no model: its build failed (see the 'e2e model' row)")
        return model["m"]

    for n in sorted(set(args.e2e_decode_batches)):
        guarded(rows, "e2e decode", f"{n} seqs x ctx {args.e2e_context}, {args.e2e_layers}L",
                lambda n=n: need_model().decode(n))
    guarded(rows, "e2e prefill", f"{args.e2e_prefill}-token prompt, {args.e2e_layers}L",
            lambda: need_model().prefill())
    model.clear()  # the weights and the KV cache go before anything runs after this section


# ---- main ---------------------------------------------------------------------------------------------------

SECTIONS = ("decode", "prefill", "mixed", "e2e")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="timed sections to run, in this order (default: all)")
    parser.add_argument("--time-budget", type=float, default=float("inf"), metavar="SECONDS",
                        help="parts not started by then become 'skipped' error rows (the table is still written)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--mixed-decodes", type=int, default=60)
    parser.add_argument("--mixed-chunk", type=int, default=512)
    parser.add_argument("--mixed-prefix", type=int, default=512, help="cached tokens before the mixed chunk")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[64, 128, 256],
                        help="decode keys per compute block (pages_per_compute_block = this / page size)")
    parser.add_argument("--prefill-blocks", type=lambda s: tuple(map(int, s.split("x"))), nargs="*",
                        default=[(8, 64), (16, 64), (32, 64), (32, 128)],
                        help="block_q (tokens; rows = block_q x 4 query heads per KV head) x keys, e.g. 16x64")
    parser.add_argument("--skip-checks", action="store_true", help="skip the kernel checks (not the e2e check)")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in interpret mode (tiny sizes)")
    e2e = parser.add_argument_group("end to end (a random Llama-3-8B-shaped model through the engine)")
    e2e.add_argument("--e2e-tiny", action="store_true",
                     help="tiny defaults for every --e2e-* size (a CPU dry run; explicit flags still win)")
    e2e.add_argument("--e2e-layers", type=int, default=32, help="layers of the timed model (the check's: below)")
    e2e.add_argument("--e2e-hidden", type=int, default=4096)
    e2e.add_argument("--e2e-heads", type=int, default=32)
    e2e.add_argument("--e2e-kv-heads", type=int, default=8)
    e2e.add_argument("--e2e-head-dim", type=int, default=128)
    e2e.add_argument("--e2e-intermediate", type=int, default=14336)
    e2e.add_argument("--e2e-vocab", type=int, default=128256)
    e2e.add_argument("--e2e-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    e2e.add_argument("--e2e-page-size", type=int, default=16)
    e2e.add_argument("--e2e-context", type=int, default=1024, help="tokens each decoding sequence has cached")
    e2e.add_argument("--e2e-decode-batches", type=int, nargs="+", default=[1, 16, 64],
                     help="running sequences of each decode row")
    e2e.add_argument("--e2e-steps", type=int, default=64, help="back-to-back decode steps per timed window")
    e2e.add_argument("--e2e-repeats", type=int, default=3, help="timed windows (decode) or prompts (prefill)")
    e2e.add_argument("--e2e-warmup-steps", type=int, default=8)
    e2e.add_argument("--e2e-prefill", type=int, default=2048, help="prompt tokens of the prefill row (one step)")
    e2e.add_argument("--e2e-copy-mib", type=int, default=1024,
                     help="copy yardstick size when the decode section has not measured one")
    e2e.add_argument("--e2e-check-layers", type=int, default=2)
    e2e.add_argument("--e2e-check-vocab", type=int, default=32000, help="at most this vocabulary in the check")
    e2e.add_argument("--e2e-check-prompts", type=int, nargs="+", default=[150, 37, 300],
                     help="prompt lengths of the check's sequences (the last one is prefilled over two steps)")
    e2e.add_argument("--e2e-check-steps", type=int, default=6)
    e2e.add_argument("--e2e-check-dtypes", nargs="+", choices=["float32", "bfloat16"],
                     default=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if args.e2e_tiny:
        parser.set_defaults(**E2E_TINY)
        args = parser.parse_args(argv)
    return args


def write_details(details: dict) -> None:
    """Rewritten after every section, so a run cut short by the call's timeout still leaves its numbers."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_kernels.json").write_text(json.dumps(details, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    global INTERPRET
    INTERPRET = args.interpret
    if INTERPRET:
        TIMING.update(warmup=1, calls=1, repeats=1)
    BUDGET.update(start=time.perf_counter(), seconds=args.time_budget)
    COPY.clear()

    command = shlex.join(["python3", "benchmarks/gpu_kernels.py"] + (sys.argv[1:] if argv is None else argv))
    print("reproduce: cd", shlex.quote(str(ROOT)), "&&", command)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, backend {jax.default_backend()}", flush=True)
    t_start = time.perf_counter()
    checks, rows = [], []
    details = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, argv=command, checks=checks,
                   timings=rows, section_seconds={})
    if not args.skip_checks:
        print("correctness (kernel vs reference):", flush=True)
        run_checks(checks)
    # The timed sections, in the order --sections names them; each appends rows of {bench, config, ms?, gbs?,
    # ratio?, tflops?, tok_s?, ...} or {bench, config, error}.
    runners = dict(decode=run_decode, prefill=run_prefill, mixed=run_mixed,
                   e2e=lambda a, r: run_e2e(a, r, checks))
    for title in args.sections:
        print(f"{title}:", flush=True)
        t0 = time.perf_counter()
        try:
            runners[title](args, rows)
        except Exception as e:  # a section's own setup failed: record it, run the next one
            rows.append(dict(bench=title, config="section", error=f"{type(e).__name__}: {e}"[:2000]))
            traceback.print_exc()
        details["section_seconds"][title] = time.perf_counter() - t0
        print(f"  ({title}: {details['section_seconds'][title]:.0f} s, {time.perf_counter() - t_start:.0f} s in)",
              flush=True)
        details["seconds"] = time.perf_counter() - t_start
        write_details(details)
    details["seconds"] = time.perf_counter() - t_start
    write_details(details)

    failed = [c["check"] for c in checks if not c["ok"]]
    errors = [f"{r['bench']} {r['config']}" for r in rows if "error" in r]
    print(f"\nchecks: {len(checks) - len(failed)}/{len(checks)} ok" + (f"; FAILED: {failed}" if failed else ""))
    print(f"{'benchmark':<22} {'config':<36} {'ms':>9} {'GB/s':>7} {'ratio':>6} {'TFLOP/s':>8} {'tok/s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['bench']:<22} {r['config']:<36} ERROR {r['error'].splitlines()[0][:60]}")
            continue
        cell = lambda key, spec: format(r[key], spec) if key in r else ""
        print(f"{r['bench']:<22} {r['config']:<36} {cell('ms', '.3f'):>9} {cell('gbs', '.0f'):>7} "
              f"{cell('ratio', '.2f'):>6} {cell('tflops', '.1f'):>8} {cell('tok_s', '.0f'):>9}")
    print("ratio: decode GB/s over the copy's (e2e: weights + KV read per step); mixed: one call over the sum of "
          f"its two parts. {details['seconds']:.0f} s in all")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # the engine's progress bars would crowd the output's tail
    sys.exit(main())
