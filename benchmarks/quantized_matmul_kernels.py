"""Weight-only quantized products on a GPU or TPU: the Pallas kernel against XLA's, on Llama-3-8B's shapes (issue 52).

What the engine's start-up choice (jaxserve/engine/kernel_choice.py) decides per layer shape, measured for
the record, with the tiles the kernels were given without a device put to the test:
1. Check: each shape and row count, the kernel's output against `quantized_matmul_reference` on the device
   (relative error to the output's largest magnitude; the interpret-mode tests hold bf16 to 1e-2).
2. Time: XLA's product and the kernel with its default tiles, by `kernel_choice.time_products` (what the
   engine times: cold weights, the best of alternating rounds), as microseconds and GB/s of codes, scales
   and zero points read; with `--sweep`, the gate/up shape again with each alternative tile.
3. A table, and the rows as JSON with `--json FILE`.

    python benchmarks/quantized_matmul_kernels.py [--rows 1 16 64] [--codes int8 int4 uint4] [--sweep]
    python benchmarks/quantized_matmul_kernels.py --tiny --interpret   # a CPU dry run of the logic (~1 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine import kernel_choice
from jaxserve.engine.kernel_choice import CODE_RANGES, LinearShape, time_products, unsupported
from jaxserve.model.linear_kernels import kernel_product
from jaxserve.quantization import QuantizedWeight
from jaxserve.quantization.weights import device_bytes
from pallas_kernels.dispatch import kernel_flavour
from pallas_kernels.quantized_matmul import quantized_matmul_reference

# Llama-3-8B's products on one device: (name, K, N).
SHAPES = [("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate/up", 4096, 14336), ("down", 14336, 4096),
          ("lm_head", 4096, 128256)]
TINY = [("q/o", 256, 256), ("gate/up", 256, 512), ("down", 512, 256)]
GROUP = 128  # the int4 checkpoints' usual group
SWEEP = {"triton": dict(block_n=[32, 64, 128], num_splits=[1, 2, 4, 8]),
         "mosaic": dict(block_n=[512, 1024, 2048], block_k=[512, 1024, 2048])}


def check(shape: LinearShape, rows: int, flavour: str, interpret: bool) -> float:
    """The kernel's relative error against the reference on random weights of `shape`."""
    lo, hi = CODE_RANGES[shape.codes]
    keys = jax.random.split(jax.random.key(rows), 4)
    _, codes, scales, zeros = shape.abstract(rows)
    w = QuantizedWeight(jax.random.randint(keys[0], codes.shape, lo, hi).astype(codes.dtype),
                        jax.random.uniform(keys[1], scales.shape, jnp.float32, 0.5, 1.5) / (hi * shape.k ** 0.5),
                        None if zeros is None else jax.random.randint(keys[2], zeros.shape, 0, 16).astype(jnp.int8))
    x = jax.random.normal(keys[3], (rows, shape.k), shape.dtype)
    got = np.asarray(jax.jit(lambda x, w: kernel_product(x, w, flavour, interpret))(x, w), np.float32)
    want = np.asarray(jax.jit(quantized_matmul_reference)(x, w.codes, w.scales, w.zeros), np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def measure(name: str, shape: LinearShape, rows: int, flavour: str, interpret: bool, **tiles) -> dict:
    row = dict(shape=name, k=shape.k, n=shape.n, codes=shape.codes, groups=shape.groups, rows=rows, tiles=tiles)
    nbytes = sum(device_bytes(a) for a in shape.abstract(rows)[1:] if a is not None)
    try:
        xla, kernel = time_products(shape, rows, flavour, jax.devices()[0], interpret, **tiles)
    except Exception as e:  # one failing tile must not hide the others' numbers
        return row | dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return row | dict(xla_us=xla * 1e6, kernel_us=kernel * 1e6, speedup=xla / kernel,
                      xla_gbs=nbytes / xla / 1e9, kernel_gbs=nbytes / kernel / 1e9)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--codes", nargs="+", choices=list(CODE_RANGES), default=["int8", "int4", "uint4"])
    ap.add_argument("--shapes", nargs="+", default=None, help="only these shapes (names as in SHAPES)")
    ap.add_argument("--sweep", action="store_true", help="the gate/up shape with each alternative tile too")
    ap.add_argument("--tiny", action="store_true", help="small shapes (with --interpret: a CPU dry run)")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in interpret mode (CPU)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    flavour, _ = kernel_flavour(jax.default_backend())
    if args.interpret:  # one copy of the weights a call: the logic, not the timings
        kernel_choice.COLD_BYTES = 1
    print(f"device: {jax.devices()[0].device_kind}, kernels: {flavour}{' (interpret)' if args.interpret else ''}")
    results = []
    shapes = [s for s in (TINY if args.tiny else SHAPES) if args.shapes is None or s[0] in args.shapes]
    for codes, (name, k, n) in itertools.product(args.codes, shapes):
        shape = LinearShape(k, n, codes, 1 if codes == "int8" else k // GROUP, codes == "uint4", "bfloat16")
        reason = unsupported(shape, flavour)
        if reason:
            results.append(dict(shape=name, k=k, n=n, codes=codes, error=f"unsupported: {reason}"))
            continue
        for rows in args.rows:
            row = measure(name, shape, rows, flavour, args.interpret)
            row["error_vs_reference"] = check(shape, rows, flavour, args.interpret)
            results.append(row)
            print(json.dumps(row), flush=True)
        if args.sweep and name == "gate/up":
            options = SWEEP[flavour]
            for values in itertools.product(*options.values()):
                tiles = dict(zip(options, values))
                for rows in args.rows:
                    results.append(measure(name, shape, rows, flavour, args.interpret, **tiles))
                    print(json.dumps(results[-1]), flush=True)
    print("\n| shape | codes | rows | tiles | XLA us | kernel us | speedup | kernel GB/s | error |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "error" in r:
            print(f"| {r['shape']} | {r['codes']} | {r.get('rows', '')} | {r.get('tiles', '')} | {r['error']} |")
            continue
        checked = f"{r['error_vs_reference']:.1e}" if "error_vs_reference" in r else "-"  # sweep rows: timed only
        print(f"| {r['shape']} {r['k']}x{r['n']} | {r['codes']} | {r['rows']} | {r['tiles'] or 'default'} | "
              f"{r['xla_us']:.1f} | {r['kernel_us']:.1f} | {r['speedup']:.2f}x | {r['kernel_gbs']:.0f} | {checked} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
