"""Check and time the Pallas Triton ragged paged-attention kernel on a GPU, beside the pure-jnp reference, and
the engine end to end on a random Llama-3-8B-shaped model.

Run from the repository root on the GPU machine (installs nothing; see "Time" below):

    python3 benchmarks/gpu_kernels.py --time-budget 390     # device call timeout 480 s; writes $OUT/gpu_kernels.json
    python3 benchmarks/gpu_kernels.py --interpret --batch 2 --context 64 --chunk 32 --mixed-decodes 2 \\
        --mixed-chunk 16 --page-sizes 16 --block-tokens 16 --prefill-blocks 8x16 --long-context 96 \
        --e2e-tiny   # CPU dry run
    python3 benchmarks/gpu_kernels.py --interpret --skip-checks --sections e2e --e2e-tiny   # e2e only (~20 s)

1. Correctness: the kernel against `ragged_paged_attention_reference`, float32 and bfloat16, on shuffled pages
   with ragged mixes (decodes, first prefill chunks, chunks over a cached prefix, padding sequences and
   padding rows, lengths 1 and page boundaries), plain and with soft_cap + sliding_window; and bfloat16
   queries over int8 and fp8 KV pages (per-token scales, `pallas_kernels/kv_quant.py`) against the
   reference over the same quantized pages; bfloat16 once more with num_kv_splits=3 (every share split).
2. Decode: batch 64 x context 2048 (one row per sequence), 32 query / 8 KV heads, head_dim 128, bf16, page
   sizes 16/32/64 and a few key-block sizes. Reports HBM GB/s (K/V bytes the kernel reads + q + out, over
   time) and its ratio to a device-to-device copy of a buffer the size of K+V measured in the same run
   (copy GB/s = read + write); at the first page size also other query tiles (--decode-block-q) and keys
   split among programs (--decode-kv-splits; the default rows run the kernel's default, up to 4 splits of at
   least 1024 keys at this bucket), more pipelining stages (--decode-num-stages, also with 2 splits) and
   more warps (--decode-num-warps). Then int8 and fp8 pages at the default key block: their bytes
   (codes plus 4-byte scales) over time, and their speed-up over bf16 pages. Then the latency case: one
   sequence of 32768 keys (--long-*) with the default splits and num_kv_splits 1, 4, 16, 32.
3. Prefill: one 2048-token first chunk (causal) with the same heads; TFLOP/s = 4 * D * H * T(T+1)/2 / time.
4. Mixed: 60 decodes plus one 512-token chunk over a 512-token cached prefix in one ragged call, against the
   same decodes and the same chunk as two separate calls (the unified kernel should cost about their sum).
5. End to end (`--sections e2e`; `--e2e-*` knobs; details in gpu_engine_step.py): a random model of
   Llama-3-8B's shape in bf16 through the engine's own path (`build_from_module` + `Engine`, the platform's
   default attention). First a greedy check of that kernel against attention_backend="reference" on a
   2-layer model with the same heads; then decode steps at 1, 16 and 64 running sequences of 1024-token
   context (ms/step, tokens/s, GB/s of weights + K/V read per step and its ratio to the copy's), and one
   2048-token prefill step (tokens/s, useful TFLOP/s).
Timings: warm-up, then the median over repeats of back-to-back calls (block_until_ready at the end of each).
Every section and part records its errors and goes on, so one broken configuration never hides the others'
numbers; the JSON under $OUT is rewritten after each section, so a run cut short still leaves what it got.

Files: this one holds sections 1-4, the command line and main(); gpu_common.py the run state and helpers
both parts share (timing, the copy yardstick, the time budget, error rows, the profile summary);
gpu_engine_section.py section 5's rows, gpu_engine_step.py its model, timings and check, and
gpu_engine_args.py its --e2e-* options.

Time (measured on an H200 on 2026-12-04, docs/performance.md): the kernel sections about 96 s, most of it
Triton compiles; e2e with 8 layers 44-107 s (the check 10-30 s, random init 6-13 s, compiling the 4 step
programs 17-68 s, fp8 the slowest); the full 32 layers were not run (random init of ~16 GB of weights through
the host, and compiling 32 unrolled layers, several minutes). `benchmarks/gpu_session.sh` runs the parts that
fit one device call, each in its own process under an overall deadline.
`--time-budget S` turns every part not started by S seconds into a "skipped" error row (the model build
needs gpu_engine_step.build_reserve_s(layers) left), so the table is printed before the device call's
timeout; if time is short, rerun with `--sections e2e --skip-checks`, or `--e2e-layers 8` (fewer layers).
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
for path in (ROOT, ROOT / "benchmarks"):  # the package, and the sibling modules when loaded by importlib
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gpu_common  # noqa: E402
import gpu_engine_args  # noqa: E402
import gpu_engine_section  # noqa: E402
from gpu_common import DTYPE, bench, guarded, measure_copy, record_check  # noqa: E402
from pallas_kernels import ragged_gpu  # noqa: E402
from pallas_kernels.kv_quant import KV_CACHE_DTYPES  # noqa: E402
from pallas_kernels.reference import ragged_paged_attention_reference  # noqa: E402
from pallas_kernels.testing import (INTERPRET_COMPILER_OPTIONS, interpreted, jitted_reference,  # noqa: E402
                                    quantize_pages, random_ragged_case)

H, KVH, D = 32, 8, 128  # the timed shapes: a Llama-3-8B-like layer


def kernel(*args, **kwargs):
    """The kernel called outside jit (the checks). In a CPU dry run it checks the kernel's logic, so it is
    compiled without LLVM's optimizations (`interpreted`)."""
    if gpu_common.INTERPRET:
        return interpreted_kernel(*args, **kwargs)
    return ragged_gpu.ragged_paged_attention_gpu(*args, **kwargs)


interpreted_kernel = interpreted(ragged_gpu.ragged_paged_attention_gpu)


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
    for setup in check_setups(gpu_common.INTERPRET):
        q_lens, kv_lens = zip(*setup["seqs"])
        max_pages = max(1, -(-max(kv_lens) // setup["s"]))
        case = random_ragged_case(rng, list(q_lens), list(kv_lens), num_kv_heads=setup["kvh"], group=setup["group"],
                                  page_size=setup["s"], head_dim=setup["d"], max_pages=max_pages,
                                  padding_tokens=setup["padding"])
        # bf16 once more with each item's keys split among 3 programs (num_kv_splits, merged after the kernel),
        # however short (min_keys_per_split=1); the others with the kernel's default splits
        for dtype, splits in (("float32", None), ("bfloat16", None), ("bfloat16", 3)):
            name = f"ragged {dtype} {setup['name']}" + (f" kv_splits={splits}" if splits else "")
            split_opts = dict(num_kv_splits=splits, min_keys_per_split=1) if splits else {}
            try:
                args = (jnp.asarray(case.q, dtype), jnp.asarray(case.paged.k_pages, dtype),
                        jnp.asarray(case.paged.v_pages, dtype), jnp.asarray(case.kv_lens),
                        jnp.asarray(case.paged.page_tables), jnp.asarray(case.cu_q_lens))
                scale = setup["d"] ** -0.5
                got = kernel(*args, sm_scale=scale, **split_opts, **setup["opts"])
                with jax.default_matmul_precision("highest"):
                    want = jitted_reference(*args, sm_scale=scale, **setup["opts"])
                padding_zero = not np.asarray(got[int(case.cu_q_lens[-1]):], np.float32).any()
                record_check(results, name, got, want, dtype, padding_zero)
            except Exception as e:  # keep going: one broken case must not hide the others' results
                results.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()
        for kv_dtype in KV_CACHE_DTYPES:
            name = f"ragged bfloat16 over {kv_dtype} pages {setup['name']}"
            try:
                (k, v), scales = quantize_pages(jnp.asarray(case.paged.k_pages), jnp.asarray(case.paged.v_pages),
                                                kv_dtype)
                args = (jnp.asarray(case.q, "bfloat16"), k, v, jnp.asarray(case.kv_lens),
                        jnp.asarray(case.paged.page_tables), jnp.asarray(case.cu_q_lens))
                opts = dict(sm_scale=setup["d"] ** -0.5, **scales, **setup["opts"])
                got = kernel(*args, **opts)
                with jax.default_matmul_precision("highest"):
                    want = jitted_reference(*args, **opts)
                padding_zero = not np.asarray(got[int(case.cu_q_lens[-1]):], np.float32).any()
                record_check(results, name, got, want, "bfloat16", padding_zero)
            except Exception as e:
                results.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()


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


def bandwidth_row(label: str, seconds: float, read_bytes: int, copy_gbs: float) -> dict:
    """A timed kernel's row: ms, GB/s of the bytes it must read, and that over the copy yardstick's GB/s."""
    gbs = read_bytes / seconds / 1e9
    print(f"  {label}: {seconds * 1e3:.3f} ms, {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)", flush=True)
    return dict(ms=seconds * 1e3, gbs=gbs, ratio=gbs / copy_gbs)


def timed_kernel(args, **opts):
    def call(*a):
        return ragged_gpu.ragged_paged_attention_gpu(*a, sm_scale=D ** -0.5, interpret=gpu_common.INTERPRET, **opts)
    fn = jax.jit(call, compiler_options=INTERPRET_COMPILER_OPTIONS if gpu_common.INTERPRET else None)
    return bench(fn, *args)


# ---- 2. decode bandwidth ----------------------------------------------------------------------------------

def run_decode(args, rows: list) -> None:
    b, ctx = args.batch, args.context
    itemsize = jnp.dtype(DTYPE).itemsize
    kv_bytes = 2 * b * KVH * ctx * D * itemsize
    qo_bytes = 2 * b * H * D * itemsize

    # The yardstick: a device-to-device copy of a buffer the size of K+V (reads and writes it once each).
    guarded(rows, "copy (K+V bytes)", f"{kv_bytes / 2**20:.0f} MiB", lambda: measure_copy(kv_bytes))
    copy_gbs = gpu_common.COPY.get("gbs", float("nan"))

    for page_size in args.page_sizes:
        batch = ragged_batch([(1, ctx)] * b, page_size, seed=page_size)
        for block_tokens in args.block_tokens:
            ppb = max(1, block_tokens // page_size)
            if ppb * page_size < 16:
                continue
            block = ppb * page_size

            def measure(ppb=ppb, block=block):
                read = 2 * b * KVH * (-(-ctx // block) * block) * D * itemsize + qo_bytes
                return bandwidth_row(f"decode pages={page_size} block={block}",
                                     timed_kernel(batch, pages_per_compute_block=ppb), read, copy_gbs)

            guarded(rows, "decode kernel", f"pages={page_size} block={block}", measure)

        # At the first page size, the default tiles with keys split among programs, or a named query tile.
        variants = ([(f"kv_splits={n}", dict(num_kv_splits=n)) for n in args.decode_kv_splits]
                    + [(f"block_q={q}", dict(block_q=q)) for q in args.decode_block_q]
                    + [(f"num_stages={n}", dict(num_stages=n)) for n in args.decode_num_stages]
                    + [(f"num_warps={n}", dict(num_warps=n)) for n in args.decode_num_warps]
                    + [(f"num_stages={n} kv_splits=2", dict(num_stages=n, num_kv_splits=2))
                       for n in args.decode_num_stages[-1:]])
        for name, opts in variants if page_size == args.page_sizes[0] else []:
            def measure_variant(name=name, opts=opts):
                return bandwidth_row(f"decode pages={page_size} {name}", timed_kernel(batch, **opts),
                                     kv_bytes + qo_bytes, copy_gbs)

            guarded(rows, "decode kernel", f"pages={page_size} {name}", measure_variant)

        def reference(batch=batch):
            fn = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=D ** -0.5))
            t = bench(fn, *batch, calls=5)
            gbs = (kv_bytes + qo_bytes) / t / 1e9
            print(f"  decode reference pages={page_size}: {t * 1e3:.3f} ms", flush=True)
            return dict(ms=t * 1e3, gbs=gbs, ratio=gbs / copy_gbs)

        guarded(rows, "decode reference", f"pages={page_size}", reference)

        for kv_dtype in KV_CACHE_DTYPES:
            def quantized(batch=batch, kv_dtype=kv_dtype):
                q, k_pages, v_pages, *rest = batch
                (k, v), scales = quantize_pages(k_pages, v_pages, kv_dtype)
                t = timed_kernel((q, k, v, *rest), **scales)
                base = timed_kernel(batch)
                read = 2 * b * KVH * ctx * (D + 4) + qo_bytes  # 1-byte codes + a float32 scale per token-head
                gbs = read / t / 1e9
                print(f"  decode {kv_dtype} pages={page_size}: {t * 1e3:.3f} ms, {gbs:.0f} GB/s, "
                      f"{base / t:.2f}x bf16 pages", flush=True)
                return dict(ms=t * 1e3, gbs=gbs, ratio=gbs / copy_gbs, speedup_vs_bf16=base / t)

            guarded(rows, f"decode kernel {kv_dtype} pages", f"pages={page_size}", quantized)
        del batch
    run_long_decode(args, rows)


def run_long_decode(args, rows: list) -> None:
    """Few sequences over a long context (the latency case): one program per sequence and KV head leaves
    most multiprocessors idle unless the keys are split among programs (`num_kv_splits`)."""
    b, ctx, page_size = args.long_batch, args.long_context, 16
    itemsize = jnp.dtype(DTYPE).itemsize
    read = 2 * b * KVH * ctx * D * itemsize + 2 * b * H * D * itemsize
    copy_gbs = gpu_common.COPY.get("gbs", float("nan"))
    batch = ragged_batch([(1, ctx)] * b, page_size, seed=5)
    for splits in [None, *args.long_kv_splits]:
        name = f"kv_splits={splits or 'default'}"

        def measure(splits=splits, name=name):
            return bandwidth_row(f"long decode {b} x {ctx} {name}", timed_kernel(batch, num_kv_splits=splits),
                                 read, copy_gbs)

        guarded(rows, "long decode kernel", f"{b} x {ctx} {name}", measure)
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
    for block_q in [None] + args.mixed_block_q:  # the default tiles, then each named one for all three calls
        tile = "" if block_q is None else f", block_q={block_q}"
        config = f"{n} decodes x {ctx} + chunk {chunk} over {prefix}{tile}"
        times = {}

        def part(name, batch, block_q=block_q, times=times):
            def measure():
                times[name] = timed_kernel(batch, block_q=block_q)
                print(f"  {name}{tile}: {times[name] * 1e3:.3f} ms", flush=True)
                extra = {}
                if name == "mixed" and {"decodes only", "chunk only"} <= times.keys():
                    extra["ratio"] = times["mixed"] / (times["decodes only"] + times["chunk only"])
                    print(f"  mixed / (decodes + chunk) = {extra['ratio']:.2f}", flush=True)
                return dict(ms=times[name] * 1e3, **extra)
            return measure

        guarded(rows, "mixed: decodes only", config, part("decodes only", only_decodes))
        guarded(rows, "mixed: chunk only", config, part("chunk only", only_chunk))
        guarded(rows, "mixed: one call", config, part("mixed", mixed))


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
                        default=[(8, 128), (8, 64), (16, 64), (32, 64), (32, 128)],
                        help="block_q (tokens; rows = block_q x 4 query heads per KV head) x keys, e.g. 16x64")
    parser.add_argument("--decode-block-q", type=int, nargs="*", default=[8],
                        help="query tiles (tokens) the decode section also times at its first page size "
                             "(8: 32 rows, the default before the tile followed the batch's shape)")
    parser.add_argument("--decode-kv-splits", type=int, nargs="*", default=[1, 4],
                        help="num_kv_splits the decode section also times at its first page size (split-K; "
                             "the default rows use the kernel's default_kv_splits)")
    parser.add_argument("--decode-num-stages", type=int, nargs="*", default=[3, 4],
                        help="Triton software-pipelining stages (default 2) the decode section also times: more "
                             "page gathers in flight")
    parser.add_argument("--decode-num-warps", type=int, nargs="*", default=[8],
                        help="warps per program (default 4 for a 16-row decode tile) the decode section also times")
    parser.add_argument("--long-batch", type=int, default=1, help="sequences of the long-context decode rows")
    parser.add_argument("--long-context", type=int, default=32768, help="their context (keys per sequence)")
    parser.add_argument("--long-kv-splits", type=int, nargs="*", default=[1, 4, 16, 32],
                        help="num_kv_splits of the long-context decode rows")
    parser.add_argument("--mixed-block-q", type=int, nargs="*", default=[8],
                        help="query tiles the mixed section also times, after the default ones")
    parser.add_argument("--skip-checks", action="store_true", help="skip the kernel checks (not the e2e check)")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in interpret mode (tiny sizes)")
    gpu_engine_args.add_arguments(parser)  # the --e2e-* options of the e2e section
    args = parser.parse_args(argv)
    if args.e2e_tiny:
        parser.set_defaults(**gpu_engine_args.E2E_TINY)
        args = parser.parse_args(argv)
    return args


def write_details(details: dict) -> None:
    """Rewritten after every section, so a run cut short by the call's timeout still leaves its numbers."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_kernels.json").write_text(json.dumps(details, indent=1))


def main(argv=None) -> int:
    args = parse_args(argv)
    # The shared run state, set on the module: its readers look it up there at each use.
    gpu_common.INTERPRET = args.interpret
    gpu_common.TIMING.update(dict(warmup=1, calls=1, repeats=1) if args.interpret else gpu_common.TIMING_DEFAULTS)
    gpu_common.BUDGET.update(start=time.perf_counter(), seconds=args.time_budget)
    gpu_common.COPY.clear()

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
                   e2e=lambda a, r: gpu_engine_section.run_e2e(a, r, checks))
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
    print("ratio: decode GB/s over the copy's (e2e: a step's least bytes, weights + KV read + written); mixed: one "
          f"call over the sum of its two parts. {details['seconds']:.0f} s in all")
    return 1 if failed or errors else 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")  # the engine's progress bars would crowd the output's tail
    sys.exit(main())
