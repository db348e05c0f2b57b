"""Weight-only quantized products: XLA's or a Pallas kernel, chosen per layer shape at start (issue 52).

1. `linear_shapes` lists the distinct products of the model's weight-only `QuantizedLinear`s as one device runs
   them: the local [K, N] of the codes (tensor parallelism splits one side), their dtype, scale groups, zero
   points, and the activations' dtype. Layers under `lax.scan` are left out: each iteration would hand the
   kernel a slice of the stacked codes, which XLA copies out first (a program compiled for a v6e shows the
   dynamic-slice fusion before the Mosaic call), where its own product reads the slice where it lies.
2. `decode_rows` are the row counts the layers see in decode-sized steps (at most MAX_ROWS): each token
   bucket's, per pipeline microbatch. A step of other rows takes the choice of the next larger count.
3. `choose_linear_kernels`: "xla" changes nothing; "pallas" gives every shape the kernel up to MAX_ROWS rows;
   "auto" on a GPU or TPU times both products on the first device (`time_products`: random weights of the
   shape, copies enough to stream 256 MB, so a GPU's 50 MB L2 holds none of them), at the fewest and the most
   rows, and between those only where the two disagree (a bisection: both stream the same weights, so the
   winner changes at most once along the rows). The kernel must be MARGIN faster to be chosen. "auto" keeps
   XLA's product on a CPU (the kernels only interpret there), on compile-only devices (`jaxserve plan`:
   nothing runs) and across processes (each host would time its own, and their programs must agree).
4. Each layer gets its shape's `KernelPlan` (a static attribute: the programs compiled at warm-up embed it),
   and the log has a line per shape with both timings and what it got.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.loader.placement import ShardedModel
from jaxserve.model.linear_kernels import KernelPlan, kernel_product
from jaxserve.model.quantized_linear import QuantizedLinear
from jaxserve.quantization import QuantizedWeight, quantized_linear
from jaxserve.quantization.weights import device_bytes
from pallas_kernels.dispatch import kernel_flavour
from pallas_kernels.quantized_matmul import MAX_ROWS
from sharding.pipeline import num_microbatches

logger = logging.getLogger(__name__)

MARGIN = 0.03  # the kernel is chosen when it takes at most 97% of XLA's time
COLD_BYTES = 256 << 20  # distinct weights one timed call streams (more than five times an H100's or H200's L2)
MAX_COPIES = 64
CALLS, ROUNDS = 4, 3  # a timing: the best of ROUNDS, each CALLS calls back to back
CODE_RANGES = {"int8": (-127, 128), "int4": (-8, 8), "uint4": (0, 16)}


@dataclasses.dataclass(frozen=True)
class LinearShape:
    k: int  # input features on one device
    n: int  # output features on one device
    codes: str  # int8 | int4 | uint4
    groups: int  # scale rows: 1 per output channel, else groups of k / groups input rows
    zeros: bool
    dtype: str  # the activations'

    def describe(self) -> str:
        scales = "per channel" if self.groups == 1 else f"groups of {self.k // self.groups}"
        return f"{self.k}x{self.n} {self.codes} {scales}, {self.dtype} x"

    def abstract(self, rows: int) -> tuple:
        """(x, codes, scales, zeros) as shapes."""
        s = jax.ShapeDtypeStruct
        zeros = s((self.groups, self.n), jnp.int8) if self.zeros else None
        return (s((rows, self.k), self.dtype), s((self.k, self.n), self.codes),
                s((self.groups, self.n), jnp.float32), zeros)


def _local(array) -> tuple[int, ...]:
    return tuple(array.sharding.shard_shape(array.shape)) if getattr(array, "sharding", None) else tuple(array.shape)


def linear_shapes(module: nnx.Module, dtype, scanned: bool) -> dict[LinearShape, list[QuantizedLinear]]:
    """The weight-only quantized layers of `module` (a merged stage model) by the product one device runs;
    `scanned`: the layers run under lax.scan (left out, see the module docstring)."""
    shapes: dict[LinearShape, list[QuantizedLinear]] = {}
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, QuantizedLinear) or node.strategy != "weight_only" or node.codes_out_in:
            continue
        if scanned and path and path[0] == "layers":
            continue
        codes, scales = node.codes.get_raw_value(), node.scales.get_raw_value()  # arrays or (plan) shapes
        if jnp.dtype(codes.dtype).name not in CODE_RANGES:  # fp8 weight-only: XLA's
            continue
        (k, n), groups = _local(codes)[-2:], _local(scales)[-2]
        shape = LinearShape(k, n, jnp.dtype(codes.dtype).name, groups, node.zeros is not None, jnp.dtype(dtype).name)
        shapes.setdefault(shape, []).append(node)
    return shapes


def decode_rows(token_buckets, pp: int) -> tuple[int, ...]:
    """Row counts of the layers' products in decode-sized steps: each bucket's rows per microbatch."""
    rows = {b // num_microbatches(b, pp) for b in token_buckets}
    return tuple(sorted(r for r in rows if r <= MAX_ROWS))


def unsupported(shape: LinearShape, flavour: str) -> str | None:
    """Why the kernel of `flavour` cannot take `shape` (its own check's words), or None."""
    x, codes, scales, zeros = shape.abstract(MAX_ROWS)
    try:
        jax.eval_shape(lambda *a: kernel_product(a[0], QuantizedWeight(*a[1:]), flavour), x, codes, scales, zeros)
    except ValueError as e:
        return str(e)
    return None


def _random_weights(shape: LinearShape, copies: int, seed: int = 0) -> list[QuantizedWeight]:
    """`copies` random weights of `shape`, made on the default device."""
    lo, hi = CODE_RANGES[shape.codes]
    _, codes, scales, zeros = shape.abstract(1)

    def one(key) -> QuantizedWeight:
        kc, ks, kz = jax.random.split(key, 3)
        c = jax.random.randint(kc, codes.shape, lo, hi).astype(codes.dtype)
        s = jax.random.uniform(ks, scales.shape, jnp.float32, 0.5, 1.5) / (hi * math.sqrt(shape.k))
        z = None if zeros is None else jax.random.randint(kz, zeros.shape, 0, 16).astype(jnp.int8)
        return QuantizedWeight(c, s, z)

    return jax.jit(lambda key: [one(k) for k in jax.random.split(key, copies)])(jax.random.key(seed))


def time_products(shape: LinearShape, rows: int, flavour: str, device, interpret: bool = False,
                  **tiles) -> tuple[float, float]:
    """Seconds one product of `rows` rows takes on `device`: (XLA's, the kernel's with `tiles`, default its own;
    `interpret`: a CPU test's)."""
    weight_bytes = sum(device_bytes(a) for a in shape.abstract(1)[1:] if a is not None)
    copies = min(MAX_COPIES, max(1, -(-COLD_BYTES // weight_bytes)))
    with jax.default_device(device):
        weights = _random_weights(shape, copies)
        x = jax.random.normal(jax.random.key(1), (rows, shape.k), shape.dtype)
    # Committed to the device, so the programs (compiled on other threads, without the default above) run there.
    x, weights = jax.device_put((x, weights), device)
    products = {"xla": lambda x, w: quantized_linear(x, w, "weight_only"),
                "kernel": lambda x, w: kernel_product(x, w, flavour, interpret, **tiles)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two compilations at once
        compiled = dict(zip(products, pool.map(
            lambda p: jax.jit(lambda x, ws: [p(x, w) for w in ws]).lower(x, weights).compile(), products.values())))
    best = dict.fromkeys(products, math.inf)
    for program in compiled.values():
        jax.block_until_ready(program(x, weights))
    for _ in range(ROUNDS):  # alternating, so a slow spell of the device meets both
        for name, program in compiled.items():
            start = time.perf_counter()
            for _ in range(CALLS):
                out = program(x, weights)
            jax.block_until_ready(out)
            best[name] = min(best[name], (time.perf_counter() - start) / (CALLS * copies))
    return best["xla"], best["kernel"]


def measured_plan(shape: LinearShape, rows: tuple[int, ...], flavour: str, device) -> tuple[KernelPlan, str]:
    """The plan timing gives `shape` at `rows`, and what the log says of it."""
    wins: dict[int, bool] = {}
    said = []

    def kernel_wins(i: int) -> bool:
        if rows[i] not in wins:
            xla, kernel = time_products(shape, rows[i], flavour, device)
            wins[rows[i]] = kernel <= (1 - MARGIN) * xla
            said.append(f"{rows[i]} rows {kernel * 1e6:.1f} us against XLA's {xla * 1e6:.1f} us")
        return wins[rows[i]]

    def settle(lo: int, hi: int) -> None:  # rows[lo] and rows[hi] timed; those between follow when they agree
        if kernel_wins(lo) == kernel_wins(hi):
            for i in range(lo + 1, hi):
                wins.setdefault(rows[i], wins[rows[lo]])
        elif hi - lo > 1:
            settle(lo, (lo + hi) // 2)
            settle((lo + hi) // 2, hi)

    settle(0, len(rows) - 1)
    return compact_plan(flavour, rows, [wins[r] for r in rows]), "; ".join(said)


def compact_plan(flavour: str, rows, kernel, interpret: bool = False) -> KernelPlan:
    """The plan of per-row choices, keeping the top row count of each run of equal choices."""
    tops = [i for i in range(len(rows)) if i == len(rows) - 1 or kernel[i] != kernel[i + 1]]
    return KernelPlan(flavour, tuple(rows[i] for i in tops), tuple(kernel[i] for i in tops), interpret)


def choose_linear_kernels(model: ShardedModel, requested: str, platform: str, token_buckets) -> ShardedModel:
    """`model` with each weight-only quantized layer's `KernelPlan` (see the module docstring)."""
    rows = decode_rows(token_buckets, model.plan.pp)
    if requested == "xla" or not rows:
        return model
    module = nnx.merge(model.graphdef, model.params)
    shapes = linear_shapes(module, model.dtype, scanned=model.layer_repeats > 1)
    if not shapes:
        return model
    if requested == "auto":
        leaves = jax.tree.leaves(model.params)
        why_not = ("on a CPU the kernels only interpret" if platform == "cpu" else
                   "compile-only devices run nothing to time" if isinstance(leaves[0], jax.ShapeDtypeStruct) else
                   "each process would time its own" if jax.process_count() > 1 else None)
        if why_not:
            logger.info("weight-only quantized products: XLA's (%s)", why_not)
            return model
    flavour, interpret = kernel_flavour(platform)
    start, device = time.perf_counter(), model.plan.mesh.devices.flat[0]
    for shape, layers in shapes.items():
        reason = unsupported(shape, flavour)
        if reason is not None:
            logger.info("weight-only %s (%d linear layers): XLA's product, the kernel does not take it (%s)",
                        shape.describe(), len(layers), reason)
            continue
        if requested == "pallas":
            plan, said = KernelPlan(flavour, (MAX_ROWS,), (True,), interpret), "--quantized-matmul pallas"
        else:
            plan, said = measured_plan(shape, rows, flavour, device)
        for layer in layers:  # a plan that never runs the kernel is no plan: the program stays XLA's alone
            layer.kernel = plan if any(plan.kernel) else None
        logger.info("weight-only %s (%d linear layers): %s (%s)", shape.describe(), len(layers), describe_plan(plan),
                    said)
    graphdef, params = nnx.split(module)
    if requested == "auto":
        logger.info("weight-only quantized products chosen in %.1fs", time.perf_counter() - start)
    return dataclasses.replace(model, graphdef=graphdef, params=params)


def describe_plan(plan: KernelPlan) -> str:
    """e.g. "pallas-triton for 1-32 rows, XLA for 33-64 rows"."""
    lo, parts = 1, []
    for top, use in zip(plan.rows, plan.kernel):
        parts.append(f"{plan.name if use else 'XLA'} for {lo}-{top} rows")
        lo = top + 1
    return ", ".join(parts)
