"""A decode step's product epilogue on GPUs: split-K partial sums + residual add + RMSNorm, one kernel (issue 52).

A decode-shaped product (o_proj, down_proj: a few rows x 4096 columns) has too few output tiles to fill an
H100's or H200's 132 multiprocessors, so its contraction is split S ways and each share writes a float32
partial product (`jaxserve/model/split_k.py`). XLA then sums them in one kernel (with the residual add), and
the next RMSNorm, a reduction over the other axis, is a kernel of its own. Here one Triton program per row:
1. sums the row's S partials in float32 (times the layer's per-column scales: an int8 weight-only layer's
   partials are products with its codes) and rounds the sum to the residual's dtype, as the product's output;
2. adds the residual (rounded to its dtype, as `x + h` is) and stores it: the layer's new residual stream;
3. RMSNorms that row in float32 and stores `weight * normed`, rounded as `llama.RMSNorm` rounds it.
`residual_rms_norm_reference` is the same in `jnp`, the definition the kernel is tested against, and what
XLA runs where the kernel is not used. A row is held whole (hidden sizes of a power of 2, up to 16384).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._paged_common import is_pow2

MAX_HIDDEN = 16384  # a row's float32 sum and norm in registers: 32 per thread at 16 warps


def _round_sum(partials: jax.Array, column_scale: jax.Array | None, dtype) -> jax.Array:
    total = jnp.sum(partials, axis=0)
    return (total if column_scale is None else total * column_scale).astype(dtype)


def residual_rms_norm_reference(partials: jax.Array, residual: jax.Array, weight: jax.Array | None, *, eps: float,
                                column_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """partials [S, T, N] float32, residual [T, N], weight [N] (None: no norm) -> (residual + sum of the
    partials [T, N], RMSNorm of it with `weight` [T, N] or None), both in the residual's dtype."""
    dtype = residual.dtype
    x = (residual.astype(jnp.float32) + _round_sum(partials, column_scale, dtype).astype(jnp.float32)).astype(dtype)
    if weight is None:
        return x, None
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    return x, weight * normed


def fits(hidden: int, splits: int) -> bool:
    """Whether the kernel takes rows of `hidden` features summed over `splits` partials."""
    return is_pow2(hidden) and 16 <= hidden <= MAX_HIDDEN and is_pow2(splits)


def _kernel(*refs, eps: float, scaled: bool):
    # refs: partials [S, N] float32 (this row's partial products), per-column scales [N] float32 (`scaled`
    # only: an int8 layer's), residual [N], weight [N]; out: the new residual [N], weight * RMSNorm of it [N].
    partials_ref, *refs = refs
    scale_ref, residual_ref, weight_ref, x_ref, normed_ref = refs if scaled else (None, *refs)
    dtype = x_ref.dtype
    total = partials_ref[0]
    for s in range(1, partials_ref.shape[0]):  # S is static and small: one [N] load each
        total = total + partials_ref[s]
    product = (total if scale_ref is None else total * scale_ref[...]).astype(dtype)
    x = (residual_ref[...].astype(jnp.float32) + product.astype(jnp.float32)).astype(dtype)
    x_ref[...] = x
    x32 = x.astype(jnp.float32)
    rms = jax.lax.rsqrt(jnp.sum(x32 * x32) / x32.shape[0] + eps)
    normed_ref[...] = weight_ref[...] * (x32 * rms).astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def residual_rms_norm_gpu(partials: jax.Array, residual: jax.Array, weight: jax.Array, *, eps: float,
                          column_scale: jax.Array | None = None,
                          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`residual_rms_norm_reference` (with a norm) as one Triton kernel, a program per row."""
    splits, rows, hidden = partials.shape
    if not fits(hidden, splits):
        raise ValueError(f"the residual-norm kernel takes a power-of-2 hidden size of 16-{MAX_HIDDEN} and a "
                         f"power-of-2 split count, got {hidden} and {splits}")
    if residual.shape != (rows, hidden) or weight.shape != (hidden,):
        raise ValueError(f"residual {residual.shape} and weight {weight.shape} do not match partials {partials.shape}")
    row = pl.BlockSpec((None, hidden), lambda t: (t, 0))
    whole = pl.BlockSpec((hidden,), lambda t: (0,))
    scales = () if column_scale is None else (column_scale.astype(jnp.float32),)
    out = jax.ShapeDtypeStruct((rows, hidden), residual.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, scaled=bool(scales)),
        grid=(rows,),
        in_specs=[pl.BlockSpec((splits, None, hidden), lambda t: (0, t, 0)), *[whole] * len(scales), row, whole],
        out_specs=[row, row],
        out_shape=[out, out],
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, hidden // 1024)), num_stages=1),
        interpret=interpret,
        name="residual_rms_norm",
    )(partials, *scales, residual, weight.astype(residual.dtype))
