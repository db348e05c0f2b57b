"""Weight-only quantized matrix products on GPUs (Pallas' Triton backend), for decode-shaped batches.

A decode step's products are bound by reading the weights: M is 1-64 rows, K x N codes are read once. So:
1. The grid is `(column tile, K split)`. A program owns `block_n` output columns and a contiguous share of
   the K steps; it loads x's `block_m` rows (M padded up to tl.dot's 16 by masked loads: rows past M read as
   0) and each step's `[block_k, block_n]` codes, converts them in registers (`step_operand`: int8 / int4 /
   uint4 less its zero points, scaled per group where a step spans several) and accumulates in float32.
2. Each code is read from HBM by exactly one program; 4-bit codes are loaded as the bytes XLA packed them in
   (Pallas reads a contiguous int4 row as uint8 and splits the nibbles). A K tail (per-channel weights whose
   K is not a multiple of block_k) is masked to zeros.
3. Unsplit, the program stores its tile in x's dtype. Split (`num_splits` > 1), each split stores its float32
   partial product and XLA adds them: a product of few columns (a 4096-wide projection is 32 tiles of 128)
   would otherwise occupy a fraction of the 132 multiprocessors of an H100 / H200, too few loads in flight
   to stream HBM. Only the real rows are stored, so a one-row batch's partials are small.

Tiles (`default_tiles`): Triton tensors have power-of-2 sizes and tl.dot wants 16 or more rows, columns and
K. block_k is 128 int8 rows or 256 int4 rows (16-32 KB of codes per step, what Triton's software pipeline
keeps in flight over `num_stages` shared-memory stages) and divides the scale group (or is a multiple of it),
so a step needs one scale row and the scales multiply the float32 product, not every weight. block_n is 128
(a wider tile needs a bigger register tile of dequantized weights), halved while the column tiles are fewer
than the multiprocessors, down to 32 bytes of codes a row (one memory sector); then K splits bring the
programs to about TARGET_PROGRAMS, as long as their float32 partials stay under an eighth of the codes' bytes.
A one-row 4096 x 4096 int8 product runs 128 tiles of 32 columns in 3 splits; 64 rows, 2 splits. These are
chosen from the hardware's figures, not measured: the engine times the kernel against XLA's product at start
and keeps the faster (jaxserve/model/linear_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._paged_common import dot_precision, is_pow2, next_pow2
from pallas_kernels.quantized_matmul import (check_quantized_matmul_args, code_bytes, scale_blocks, scale_rows,
                                             step_block, step_operand)

MIN_DOT = 16  # Triton's tl.dot needs M, N and K >= 16
BLOCK_N = 128  # output columns per program, at most
MIN_ROW_BYTES = 32  # codes per K row of a tile, at least: one 32-byte memory sector
BLOCK_K = {1: 128, 0.5: 256}  # K rows per step by bytes per code
MULTIPROCESSORS = 132  # an H100's or H200's
TARGET_PROGRAMS = 2 * MULTIPROCESSORS
PARTIAL_SHARE = 8  # split partials (float32) at most 1 / PARTIAL_SHARE of the codes' bytes


def default_tiles(rows: int, k: int, n: int, group: int, code_dtype) -> tuple[int, int, int]:
    """(block_n, block_k, num_splits) for an [rows, k] x [k, n] product with scale groups of `group` rows
    (k for per-channel scales); see the module docstring."""
    bytes_per_code = code_bytes(code_dtype)
    block_k = min(BLOCK_K[bytes_per_code], max(MIN_DOT, next_pow2(k)))
    if group < k:  # grouped: each step inside one group
        if not (is_pow2(group) and group >= MIN_DOT):
            raise ValueError(f"the Triton kernel takes scale groups of a power of 2 >= {MIN_DOT} rows, got {group}")
        block_k = min(block_k, group)
    block_n = min(BLOCK_N, max(MIN_DOT, next_pow2(n)))
    narrowest = max(MIN_DOT, int(MIN_ROW_BYTES / bytes_per_code))
    while -(-n // block_n) < MULTIPROCESSORS and block_n // 2 >= narrowest:
        block_n //= 2
    k_steps, n_tiles = -(-k // block_k), -(-n // block_n)
    partial_cap = int(k * bytes_per_code) // (4 * PARTIAL_SHARE * max(rows, 1))
    splits = max(1, min(k_steps, -(-TARGET_PROGRAMS // n_tiles), partial_cap))
    return block_n, block_k, -(-k_steps // -(-k_steps // splits))  # no split left without steps


def _kernel(x_ref,  # [block_m, K] activations: rows from M on are masked to 0
            codes_ref,  # [K, block_n] this program's columns of the codes
            scales_ref,  # [G / r, r, block_n] float32: `scale_blocks`, r scale rows per K step
            *refs,  # zeros_ref like scales_ref (int8), for uint4 codes; then o_ref [block_m, block_n]: the
            #         product in x's dtype, or with splits this split's float32 partial
            rows: int, features: int, block_k: int, group: int, k_steps: int, steps_per_split: int,
            has_zeros: bool, precision):
    zeros_ref, o_ref = refs if has_zeros else (None, *refs)
    block_m, block_n = o_ref.shape
    first = pl.program_id(1) * steps_per_split
    r = scales_ref.shape[1]
    row_ok = (lax.broadcasted_iota(jnp.int32, (block_m, block_k), 0) < rows)
    ragged_k = features % block_k != 0  # per-channel weights only: a grouped K is whole steps

    def body(i, acc):
        step = first + i
        k0 = step * block_k
        x_mask, c_mask = row_ok, None
        if ragged_k:
            x_mask = x_mask & (k0 + lax.broadcasted_iota(jnp.int32, (block_m, block_k), 1) < features)
            c_mask = k0 + lax.broadcasted_iota(jnp.int32, (block_k, block_n), 0) < features
        x = plgpu.load(x_ref.at[:, pl.ds(k0, block_k)], mask=x_mask, other=0)
        codes = plgpu.load(codes_ref.at[pl.ds(k0, block_k), :], mask=c_mask, other=0 if ragged_k else None)
        at = step_block(step, block_k, group, r)
        scales = scales_ref[at]
        zeros = zeros_ref[at] if has_zeros else None
        w, after = step_operand(codes, scales, zeros, x.dtype)
        part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)
        return acc + (part if after is None else part * after)

    count = jnp.minimum(steps_per_split, k_steps - first)
    acc = lax.fori_loop(0, count, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)  # rows past M and columns past N: masked by the block's bounds


def _call(x, codes, scales3, zeros3, *, block_m, block_n, block_k, group, num_splits, num_warps, num_stages,
          interpret):
    rows, features = x.shape
    n = codes.shape[1]
    k_steps = -(-features // block_k)
    steps_per_split = -(-k_steps // num_splits)
    kernel = functools.partial(_kernel, rows=rows, features=features, block_k=block_k, group=group,
                               k_steps=k_steps, steps_per_split=steps_per_split, has_zeros=zeros3 is not None,
                               precision=dot_precision(x.dtype))
    g3 = scales3.shape[:2]
    in_specs = [pl.BlockSpec((block_m, features), lambda j, s: (0, 0)),
                pl.BlockSpec((features, block_n), lambda j, s: (0, j)),
                pl.BlockSpec((*g3, block_n), lambda j, s: (0, 0, j))]
    operands = [x, codes, scales3]
    if zeros3 is not None:
        in_specs.append(pl.BlockSpec((*g3, block_n), lambda j, s: (0, 0, j)))
        operands.append(zeros3)
    if num_splits == 1:
        out_spec = pl.BlockSpec((block_m, block_n), lambda j, s: (0, j))
        out_shape = jax.ShapeDtypeStruct((rows, n), x.dtype)
    else:
        out_spec = pl.BlockSpec((None, block_m, block_n), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((num_splits, rows, n), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(-(-n // block_n), num_splits),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="quantized_matmul_triton",
    )(*operands)
    return out if num_splits == 1 else out.sum(axis=0).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def quantized_matmul_gpu(x: jax.Array, codes: jax.Array, scales: jax.Array, zeros: jax.Array | None = None, *,
                         block_n: int | None = None, block_k: int | None = None, num_splits: int | None = None,
                         num_warps: int = 4, num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """Triton weight-only quantized product; same contract as `quantized_matmul_reference`.

    Args:
      x, codes, scales, zeros: as in `quantized_matmul_reference` (x of at most MAX_ROWS rows is what the
        tiles are chosen for; more rows run, padded to a power of 2).
      block_n: output columns per program (a power of 2 >= 16; default `default_tiles`).
      block_k: K rows per step (a power of 2 >= 16 that divides the scale group or is a multiple of it).
      num_splits: programs per column tile, each summing a contiguous share of the K steps (float32
        partials added after the kernel); default `default_tiles`.
      num_warps, num_stages: Triton launch options.
      interpret: run in Pallas interpret mode (CPU testing).
    Returns:
      [M, N] in x's dtype.
    """
    check_quantized_matmul_args(x, codes, scales, zeros)
    (rows, features), n = x.shape, codes.shape[1]
    group = features // scales.shape[0]
    default_n, default_k, default_splits = default_tiles(rows, features, n, group, codes.dtype)
    block_n, block_k = block_n or default_n, block_k or default_k
    num_splits = num_splits or default_splits
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if not (is_pow2(value) and value >= MIN_DOT):
            raise ValueError(f"{name} must be a power of 2 >= {MIN_DOT} (Triton's tensors and tl.dot), got {value}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    r = scale_rows(block_k, group, features)
    zeros3 = None if zeros is None else scale_blocks(zeros, r)
    return _call(x, codes, scale_blocks(scales, r), zeros3, block_m=max(MIN_DOT, next_pow2(rows)), block_n=block_n,
                 block_k=block_k, group=group, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                 interpret=interpret)
