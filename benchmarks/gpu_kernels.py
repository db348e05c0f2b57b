"""Check and time the Pallas Triton attention kernels on a GPU, beside the pure-jnp reference.

Run from the repository root on the GPU machine (installs nothing; ~1-3 minutes on an H200):

    python3 benchmarks/gpu_kernels.py            # writes $OUT/gpu_kernels.json when OUT is set

1. Correctness: every GPU kernel against its reference, float32 and bfloat16, on shuffled pages with ragged
   lengths (0, 1, page boundaries), plain and with soft_cap + sliding_window.
2. Decode: batch 64 x context 2048, 32 query / 8 KV heads, head_dim 128, bf16, page sizes 16/32/64 and a few
   compute-block sizes. Reports HBM GB/s (K/V bytes the kernel reads + q + out, over time) and its ratio to a
   device-to-device copy of a buffer the size of K+V measured in the same run (copy GB/s = read + write).
3. Prefill: one 2048-token chunk (causal) with the same heads; TFLOP/s = 4 * D * H * T(T+1)/2 / time.
Timings: warm-up, then the median over repeats of back-to-back calls (block_until_ready at the end of each).
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

from pallas_kernels import decode_gpu, prefill_gpu  # noqa: E402
from pallas_kernels.reference import (paged_decode_attention_reference,  # noqa: E402
                                      paged_prefill_attention_reference)
from pallas_kernels.testing import TOLERANCES, random_paged_case  # noqa: E402

INTERPRET = False  # --interpret: a CPU dry run of this script's logic (use tiny sizes)


def paged_decode_attention_gpu(*args, **kwargs):
    return decode_gpu.paged_decode_attention_gpu(*args, interpret=INTERPRET, **kwargs)


def paged_prefill_attention_gpu(*args, **kwargs):
    return prefill_gpu.paged_prefill_attention_gpu(*args, interpret=INTERPRET, **kwargs)


def bench(fn, *args, warmup: int = 3, calls: int = 20, repeats: int = 5) -> float:
    """Median seconds per call over `repeats` runs of `calls` back-to-back calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def max_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


# ---- 1. correctness ---------------------------------------------------------------------------------------

def run_checks(results: list) -> None:
    rng = np.random.default_rng(0)
    decode_setups = [
        dict(name="G4 D128 S16", kvh=8, group=4, d=128, s=16, lengths=[0, 1, 16, 17, 255, 256, 511, 1000],
             max_pages=64, opts={}),
        dict(name="G1 D64 S32 cap+win", kvh=4, group=1, d=64, s=32, lengths=[1, 32, 33, 300, 0, 129],
             max_pages=16, opts=dict(soft_cap=20.0, sliding_window=100)),
    ]
    for setup in decode_setups:
        case = random_paged_case(rng, setup["lengths"], num_kv_heads=setup["kvh"], page_size=setup["s"],
                                 head_dim=setup["d"], max_pages=setup["max_pages"])
        q32 = rng.standard_normal((len(setup["lengths"]), setup["kvh"] * setup["group"], setup["d"]))
        for dtype in ("float32", "bfloat16"):
            name = f"decode {dtype} {setup['name']}"
            try:
                args = (jnp.asarray(q32, dtype), jnp.asarray(case.k_pages, dtype), jnp.asarray(case.v_pages, dtype),
                        jnp.asarray(setup["lengths"], jnp.int32), jnp.asarray(case.page_tables))
                scale = setup["d"] ** -0.5
                got = paged_decode_attention_gpu(*args, sm_scale=scale, **setup["opts"])
                with jax.default_matmul_precision("highest"):
                    want = paged_decode_attention_reference(*args, sm_scale=scale, **setup["opts"])
                record_check(results, name, got, want, dtype)
            except Exception as e:  # keep going: one broken kernel must not hide the others' numbers
                results.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()

    prefill_setups = [
        dict(name="G4 D128 S16 q300+256", kvh=8, group=4, d=128, s=16, q_start=300, chunk=256, kv_len=550,
             max_pages=40, opts={}),
        dict(name="G1 D64 S32 cap+win q0+200", kvh=4, group=1, d=64, s=32, q_start=0, chunk=200, kv_len=200,
             max_pages=8, opts=dict(soft_cap=20.0, sliding_window=64)),
    ]
    for setup in prefill_setups:
        case = random_paged_case(rng, [setup["kv_len"]], num_kv_heads=setup["kvh"], page_size=setup["s"],
                                 head_dim=setup["d"], max_pages=setup["max_pages"])
        q32 = rng.standard_normal((setup["chunk"], setup["kvh"] * setup["group"], setup["d"]))
        for dtype in ("float32", "bfloat16"):
            name = f"prefill {dtype} {setup['name']}"
            try:
                args = (jnp.asarray(q32, dtype), jnp.asarray(case.k_pages, dtype), jnp.asarray(case.v_pages, dtype),
                        jnp.int32(setup["q_start"]), jnp.int32(setup["kv_len"]), jnp.asarray(case.page_tables[0]))
                scale = setup["d"] ** -0.5
                got = paged_prefill_attention_gpu(*args, sm_scale=scale, **setup["opts"])
                with jax.default_matmul_precision("highest"):
                    want = paged_prefill_attention_reference(*args, sm_scale=scale, **setup["opts"])
                record_check(results, name, got, want, dtype)
            except Exception as e:
                results.append(dict(check=name, ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()


def record_check(results, name, got, want, dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ok = bool(np.all(np.abs(g - w) <= atol + rtol * np.abs(w))) and bool(np.isfinite(g).all())
    results.append(dict(check=name, ok=ok, max_abs_err=max_err(got, want), atol=atol, rtol=rtol))
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |err| {results[-1]['max_abs_err']:.2e}", flush=True)


# ---- 2. decode bandwidth ----------------------------------------------------------------------------------

def paged_cache(key, num_kv_heads, num_pages, page_size, head_dim, dtype):
    k1, k2 = jax.random.split(key)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    return jax.random.normal(k1, shape, dtype), jax.random.normal(k2, shape, dtype)


def run_decode(args, rows: list) -> float:
    b, ctx, h, kvh, d = args.batch, args.context, 32, 8, 128
    dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = 2 * b * kvh * ctx * d * itemsize
    qo_bytes = 2 * b * h * d * itemsize

    # The yardstick: a device-to-device copy of a buffer the size of K+V (reads and writes it once each).
    buf = jnp.ones((kv_bytes // 2,), jnp.bfloat16)
    t_copy = bench(jax.jit(jnp.copy), buf)
    copy_gbs = 2 * kv_bytes / t_copy / 1e9
    del buf
    rows.append(dict(bench="copy (K+V bytes)", config=f"{kv_bytes / 2**20:.0f} MiB", ms=t_copy * 1e3,
                     gbs=copy_gbs, ratio=1.0))
    print(f"  copy: {copy_gbs:.0f} GB/s", flush=True)

    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (b, h, d), dtype)
    lengths = jnp.full((b,), ctx, jnp.int32)
    scale = d ** -0.5
    for page_size in args.page_sizes:
        max_pages = -(-ctx // page_size)
        num_pages = 1 + b * max_pages
        k_pages, v_pages = paged_cache(jax.random.PRNGKey(page_size), kvh, num_pages, page_size, d, dtype)
        perm = jax.random.permutation(jax.random.PRNGKey(1), jnp.arange(1, num_pages, dtype=jnp.int32))
        tables = perm.reshape(b, max_pages)
        for block_tokens in args.block_tokens:
            ppb = max(1, block_tokens // page_size)
            if ppb * page_size < 16:
                continue
            name = f"pages={page_size} block={ppb * page_size}"
            try:
                fn = jax.jit(lambda *a, ppb=ppb: paged_decode_attention_gpu(*a, sm_scale=scale,
                                                                            pages_per_compute_block=ppb))
                t = bench(fn, q, k_pages, v_pages, lengths, tables)
                block = ppb * page_size
                read = 2 * b * kvh * (-(-ctx // block) * block) * d * itemsize + qo_bytes
                gbs = read / t / 1e9
                rows.append(dict(bench="decode kernel", config=name, ms=t * 1e3, gbs=gbs, ratio=gbs / copy_gbs))
                print(f"  decode {name}: {t * 1e3:.3f} ms, {gbs:.0f} GB/s ({gbs / copy_gbs:.2f} of copy)", flush=True)
            except Exception as e:
                rows.append(dict(bench="decode kernel", config=name, error=f"{type(e).__name__}: {e}"[:2000]))
                traceback.print_exc()
        try:
            ref = jax.jit(lambda *a: paged_decode_attention_reference(*a, sm_scale=scale))
            t = bench(ref, q, k_pages, v_pages, lengths, tables, calls=5)
            gbs = (kv_bytes + qo_bytes) / t / 1e9
            rows.append(dict(bench="decode reference", config=f"pages={page_size}", ms=t * 1e3, gbs=gbs,
                             ratio=gbs / copy_gbs))
            print(f"  decode reference pages={page_size}: {t * 1e3:.3f} ms", flush=True)
        except Exception as e:
            rows.append(dict(bench="decode reference", config=f"pages={page_size}", error=str(e)[:2000]))
        del k_pages, v_pages
    return copy_gbs


# ---- 3. prefill FLOP/s -------------------------------------------------------------------------------------

def run_prefill(args, rows: list) -> None:
    t_len, h, kvh, d, page_size = args.chunk, 32, 8, 128, 16
    dtype = jnp.bfloat16
    max_pages = -(-t_len // page_size)
    k_pages, v_pages = paged_cache(jax.random.PRNGKey(7), kvh, 1 + max_pages, page_size, d, dtype)
    table = jax.random.permutation(jax.random.PRNGKey(8), jnp.arange(1, 1 + max_pages, dtype=jnp.int32))
    q = jax.random.normal(jax.random.PRNGKey(9), (t_len, h, d), dtype)
    flops = 4 * d * h * t_len * (t_len + 1) / 2
    scale = d ** -0.5
    configs = [("default", {})] + [
        (f"block_q={bq} keys={bk}", dict(block_q=bq, pages_per_compute_block=max(1, bk // page_size)))
        for bq, bk in args.prefill_blocks]
    for name, opts in configs:
        try:
            fn = jax.jit(lambda *a, opts=opts: paged_prefill_attention_gpu(*a, sm_scale=scale, **opts))
            t = bench(fn, q, k_pages, v_pages, jnp.int32(0), jnp.int32(t_len), table, calls=10)
            rows.append(dict(bench="prefill kernel", config=name, ms=t * 1e3, tflops=flops / t / 1e12))
            print(f"  prefill {name}: {t * 1e3:.3f} ms, {flops / t / 1e12:.1f} TFLOP/s", flush=True)
        except Exception as e:
            rows.append(dict(bench="prefill kernel", config=name, error=f"{type(e).__name__}: {e}"[:2000]))
            traceback.print_exc()
    try:
        ref = jax.jit(lambda *a: paged_prefill_attention_reference(*a, sm_scale=scale))
        t = bench(ref, q, k_pages, v_pages, jnp.int32(0), jnp.int32(t_len), table, calls=5)
        rows.append(dict(bench="prefill reference", config="", ms=t * 1e3, tflops=flops / t / 1e12))
    except Exception as e:
        rows.append(dict(bench="prefill reference", config="", error=str(e)[:2000]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[64, 128, 256],
                        help="decode keys per compute block (pages_per_compute_block = this / page size)")
    parser.add_argument("--prefill-blocks", type=lambda s: tuple(map(int, s.split("x"))), nargs="*",
                        default=[(16, 64), (32, 32), (32, 128)], help="block_q x keys, e.g. 32x64")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--interpret", action="store_true", help="CPU dry run in interpret mode (tiny sizes)")
    args = parser.parse_args()
    global INTERPRET
    INTERPRET = args.interpret

    command = shlex.join(["python3", "benchmarks/gpu_kernels.py"] + sys.argv[1:])
    print("reproduce: cd", shlex.quote(str(ROOT)), "&&", command)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, backend {jax.default_backend()}", flush=True)
    t_start = time.perf_counter()
    checks, rows = [], []
    if not args.skip_checks:
        print("correctness (kernel vs reference):", flush=True)
        run_checks(checks)
    print("decode:", flush=True)
    run_decode(args, rows)
    print("prefill:", flush=True)
    run_prefill(args, rows)

    details = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, argv=sys.argv, checks=checks,
                   timings=rows, seconds=time.perf_counter() - t_start)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "gpu_kernels.json").write_text(json.dumps(details, indent=1))

    failed = [c["check"] for c in checks if not c["ok"]]
    print(f"\nchecks: {len(checks) - len(failed)}/{len(checks)} ok" + (f"; FAILED: {failed}" if failed else ""))
    print(f"{'benchmark':<20} {'config':<26} {'ms':>9} {'GB/s':>7} {'xcopy':>6} {'TFLOP/s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['bench']:<20} {r['config']:<26} ERROR {r['error'].splitlines()[0][:60]}")
            continue
        gbs = f"{r['gbs']:.0f}" if "gbs" in r else ""
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        tfl = f"{r['tflops']:.1f}" if "tflops" in r else ""
        print(f"{r['bench']:<20} {r['config']:<26} {r['ms']:>9.3f} {gbs:>7} {ratio:>6} {tfl:>8}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
