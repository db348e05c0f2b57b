"""Weight-only quantized matrix products on TPUs (Pallas' Mosaic backend), for decode-shaped batches.

A decode step's products are bound by reading the weights (M is 1-64 rows), so the kernel streams each code
from HBM once, through VMEM, and keeps everything else there:
1. The grid is `(column tile, K step)`: the column tiles are parallel, the K steps run in order (Mosaic's
   pipeline double-buffers each step's `[block_k, block_n]` codes, x's `[M, block_k]` rows and the step's
   scale rows, copying the next step's while this one computes).
2. A step dequantizes its codes in VMEM (`step_operand`: int8 / int4 / uint4 less its zero points, per group
   scaled where the step spans several groups), multiplies on the MXU with float32 accumulation into a VMEM
   scratch, and the last step writes the tile in x's dtype. x's block is all of its rows (M needs no
   padding: a block equal to the array's dimension is always allowed).
3. A column tile past N reads codes beyond the array's edge into columns that are never written back; K is
   never ragged (block_k divides K), so no garbage reaches a sum.

Tiles (`default_tiles`): lane dimensions are multiples of 128 (or the whole dimension) and int8 / int4 codes
are tiled 32 / 64 rows deep, so block_k is a multiple of 128 that divides K and the scale group (or is a
multiple of it), or all of K; block_n is up to 1024 columns. A grid step costs about 0.35 us besides its DMA,
which at v5e's 819 GB/s is the time of 280 KB, so a step carries about TILE_CODES codes (1 MiB of int8,
0.5 MiB of int4): the pipeline's two buffers of codes plus the step's float32 dequantized tile stay well
under the 16 MiB of scoped VMEM a v5e gives a kernel by default (Mosaic reports 1.3-2.6 MiB used for the
default tiles); larger explicit tiles ask for `vmem_limit_bytes` from `vmem_bytes`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import dot_precision, tpu_interpret_params
from pallas_kernels.quantized_matmul import (check_quantized_matmul_args, code_bytes, scale_blocks, scale_rows,
                                             step_block, step_operand)

LANES = 128
MAX_BLOCK_N = 1024
TILE_CODES = 1 << 20  # codes per K step (block_k x block_n), see the module docstring
DEFAULT_VMEM = 16 << 20  # scoped VMEM a kernel gets without asking: 16 MiB on v5e, 32 MiB on v6e
MAX_VMEM = 64 << 20  # what the kernel may ask for: half a v5e's / v6e's 128 MiB of VMEM


def _column_tile(n: int) -> int:
    """Output columns per tile: the largest multiple of 128 up to MAX_BLOCK_N that divides N, else (N not a
    multiple of 128) all of N when it is small, MAX_BLOCK_N with a ragged last tile when it is not."""
    if n % LANES:
        return n if n <= MAX_BLOCK_N else MAX_BLOCK_N
    return next(b for b in range(MAX_BLOCK_N, 0, -LANES) if n % b == 0)


def default_tiles(rows: int, k: int, n: int, group: int, code_dtype) -> tuple[int, int]:
    """(block_n, block_k) for an [rows, k] x [k, n] product with scale groups of `group` rows (k for
    per-channel scales); see the module docstring. Raises ValueError for a K no tile fits."""
    del rows, code_dtype  # the tile is sized by codes; their bytes only change how long a step takes
    block_n = _column_tile(n)
    budget = max(LANES, TILE_CODES // block_n)
    fits = [b for b in range(LANES, min(budget, k) + 1, LANES)
            if k % b == 0 and (group == k or group % b == 0 or b % group == 0)]
    if fits:
        return block_n, max(fits)
    if k * block_n <= 4 * TILE_CODES:  # a K that is not a multiple of 128 (a small model): one step
        return block_n, k
    raise ValueError(f"no K step of a multiple of {LANES} rows divides K={k} and the scale group of {group} rows")


def vmem_bytes(rows: int, block_k: int, block_n: int, x_dtype, code_dtype, r: int, has_zeros: bool) -> int:
    """VMEM the kernel needs: double-buffered x, codes, scales (and zeros) and output blocks, the float32
    accumulator, and the step's dequantized tile (float32, and in x's dtype)."""
    x_bytes = jnp.dtype(x_dtype).itemsize
    blocks = (rows * block_k * x_bytes + block_k * block_n * code_bytes(code_dtype)
              + r * block_n * (4 + has_zeros) + rows * block_n * x_bytes)
    return int(2 * blocks + rows * block_n * 4 + block_k * block_n * (4 + x_bytes))


def _kernel(x_ref,  # [M, block_k] this step's activations
            codes_ref,  # [block_k, block_n] this step's codes of this column tile
            scales_ref,  # [r, block_n] float32: the step's scale rows (`scale_blocks`)
            *refs,  # zeros_ref [r, block_n] int8 for uint4 codes; o_ref [M, block_n]; acc_ref [M, block_n] f32
            has_zeros: bool, precision):
    zeros_ref, o_ref, acc_ref = refs if has_zeros else (None, *refs)
    step = pl.program_id(1)

    @pl.when(step == 0)
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    x = x_ref[...]
    w, after = step_operand(codes_ref[...], scales_ref[...], zeros_ref[...] if has_zeros else None, x.dtype)
    part = lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    acc_ref[...] += part if after is None else part * after

    @pl.when(step == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _call(x, codes, scales3, zeros3, *, block_n, block_k, group, interpret):
    rows, features = x.shape
    n = codes.shape[1]
    r = scales3.shape[1]
    at = functools.partial(step_block, block_k=block_k, group=group, rows=r)
    scale_spec = pl.BlockSpec((None, r, block_n), lambda j, k: (at(k), 0, j))
    in_specs = [pl.BlockSpec((rows, block_k), lambda j, k: (0, k)),
                pl.BlockSpec((block_k, block_n), lambda j, k: (k, j)),
                scale_spec] + ([scale_spec] if zeros3 is not None else [])
    # Twice the estimate, asked for only past the smallest default (explicit tiles can be large).
    need = 2 * vmem_bytes(rows, block_k, block_n, x.dtype, codes.dtype, r, zeros3 is not None)
    kernel = functools.partial(_kernel, has_zeros=zeros3 is not None, precision=dot_precision(x.dtype))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n, block_n), features // block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((rows, block_n), lambda j, k: (0, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((rows, block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=None if need <= DEFAULT_VMEM else min(MAX_VMEM, need)),
        interpret=tpu_interpret_params(interpret),
        name="quantized_matmul_mosaic",
    )(x, codes, scales3, *([] if zeros3 is None else [zeros3]))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "interpret"))
def quantized_matmul_tpu(x: jax.Array, codes: jax.Array, scales: jax.Array, zeros: jax.Array | None = None, *,
                         block_n: int | None = None, block_k: int | None = None, interpret=False) -> jax.Array:
    """Mosaic weight-only quantized product; same contract as `quantized_matmul_reference`.

    Args:
      x, codes, scales, zeros: as in `quantized_matmul_reference` (x of at most MAX_ROWS rows is what the
        tiles are chosen for).
      block_n: output columns per tile (a multiple of 128, or N; default `default_tiles`).
      block_k: K rows per step (a multiple of 128 that divides K and divides the scale group or is a
        multiple of it, or K; default `default_tiles`).
      interpret: run in Pallas TPU interpret mode (CPU testing); a `pltpu.InterpretParams` is passed on.
    Returns:
      [M, N] in x's dtype.
    """
    check_quantized_matmul_args(x, codes, scales, zeros)
    (rows, features), n = x.shape, codes.shape[1]
    group = features // scales.shape[0]
    if block_n is None or block_k is None:
        default_n, default_k = default_tiles(rows, features, n, group, codes.dtype)
        block_n, block_k = block_n or default_n, block_k or default_k
    if not (block_n == n or block_n % LANES == 0):
        raise ValueError(f"block_n must be a multiple of {LANES} or N={n}, got {block_n}")
    if not (block_k == features or block_k % LANES == 0 and features % block_k == 0):
        raise ValueError(f"block_k must be a multiple of {LANES} that divides K={features}, or K, got {block_k}")
    r = scale_rows(block_k, group, features)
    zeros3 = None if zeros is None else scale_blocks(zeros, r)
    return _call(x, codes, scale_blocks(scales, r), zeros3, block_n=block_n, block_k=block_k, group=group,
                 interpret=interpret)
