"""`y = x @ W` with a `QuantizedWeight`, three ways, and which way each backend takes.

1. `weight_only`: the codes convert to x's dtype as the matmul's operand (fused into it on GPU / TPU;
   XLA:CPU materializes it each step) and the per-channel scales multiply the product's columns
   (per-block scales: one partial product per block, scaled, summed), so no dequantized W is kept.
   Zero points come off as (row sums of x) x (zeros x scales).
2. `dynamic_int8`: each row of x is quantized on the fly (scale = row absmax / 127, round half to even,
   as vLLM's and compressed-tensors' per-token activation quantization), an int8 x int8 dot accumulates in
   int32 (`preferred_element_type`), and the result is scaled by row scale x column scale. The integer
   units of CPUs (VNNI) and TPUs (the MXU's int8 mode) run it at several times float32's rate.
3. `dynamic_fp8`: the same with e4m3 activations and fp8 weights, accumulated in float32: Hopper's fp8
   tensor cores.
`default_strategy` picks per platform and weight dtype, from the measurements in docs/quantization.md. A
weight-only layer may run its product as a Pallas kernel instead (`QuantizedLinear.kernel`, chosen at start).
A batch of one row can be padded to more (`min_rows`): the CPU's tuned integer GEMM starts at two rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.quantization.weights import QMAX, QuantizedWeight
from pallas_kernels.kv_quant import symmetric_codes

STRATEGIES = ("weight_only", "dynamic_int8", "dynamic_fp8")
_INT8 = jnp.dtype(jnp.int8)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)


def default_strategy(platform: str, weight_dtype) -> str:
    """How a backend runs a linear layer with weights of `weight_dtype` (see docs/quantization.md)."""
    weight_dtype = jnp.dtype(weight_dtype)
    platform = platform.lower()
    if weight_dtype == _FP8:
        # fp8 tensor cores on Hopper GPUs; CPUs and TPU v5e have no fp8 arithmetic, only fp8 storage (on the
        # CPU weight-only runs at 0.15-0.5x float32: re-quantizing to int8 at load is the fast option).
        return "dynamic_fp8" if platform in ("gpu", "cuda") else "weight_only"
    if weight_dtype == _INT8:
        # VNNI / AMX on CPUs, the int8 MXU on TPUs. On GPUs decode steps are bound by bytes, which both read
        # alike: weight-only measured as fast or faster on an H200 and is more accurate, and there the engine
        # may run its products as a Pallas kernel (jaxserve/engine/kernel_choice.py).
        return "weight_only" if platform in ("gpu", "cuda") else "dynamic_int8"
    return "weight_only"  # 4-bit codes: their point is bytes (decode steps are bound by bytes on GPU and TPU)


def _dot(a, b, dtype):
    """[M, K] x [K, N] contracted on K, accumulated in `dtype`."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=dtype)


def _dot_out_in(a, b, dtype):
    """[M, K] x [N, K] contracted on K: codes stored [out, in] (`codes_out_in`)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=dtype)


def _block_dot(x, codes, scales, accumulate):
    """sum over input blocks b of (x_b @ codes_b) * scales_b, for x [M, in] and codes [in, out]."""
    blocks, out = scales.shape
    if blocks == 1:
        return _dot(x, codes, accumulate).astype(jnp.float32) * scales
    rows = x.shape[0]
    xb = x.reshape(rows, blocks, -1).swapaxes(0, 1)  # [blocks, M, block]
    cb = codes.reshape(blocks, -1, out)
    partial = lax.dot_general(xb, cb, (((2,), (1,)), ((0,), (0,))), preferred_element_type=accumulate)
    return jnp.einsum("bmo,bo->mo", partial.astype(jnp.float32), scales)


def _zero_correction(x_rows_sums, qw: QuantizedWeight):
    """(sum of x over each block's rows) x zeros x scales, [M, out]: what the zero points take away."""
    return x_rows_sums @ (qw.zeros.astype(jnp.float32) * qw.scales)


def _row_sums(x, blocks):
    return x.reshape(x.shape[0], blocks, -1).sum(axis=-1, dtype=jnp.float32)


def _weight_only(x, qw: QuantizedWeight):
    compute = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    y = _block_dot(x, qw.codes.astype(compute), qw.scales, jnp.float32)
    if qw.zeros is not None:
        y = y - _zero_correction(_row_sums(x.astype(jnp.float32), qw.scales.shape[0]), qw)
    return y


def _dynamic(x, qw: QuantizedWeight, act_dtype, act_blocks: int = 1, codes_out_in: bool = False):
    x = x.astype(jnp.float32)
    accumulate = jnp.int32 if act_dtype == _INT8 else jnp.float32
    codes_w = qw.codes if qw.codes.dtype == act_dtype else qw.codes.astype(act_dtype)  # int4 -> int8 is exact
    if act_blocks > 1:
        return _dynamic_blocked(x, qw, codes_w, act_dtype, accumulate, act_blocks)
    codes_x, row_scale = symmetric_codes(x, jnp.max(jnp.abs(x), axis=-1, keepdims=True), QMAX[act_dtype], act_dtype)
    if codes_out_in:
        return _dot_out_in(codes_x, codes_w, accumulate).astype(jnp.float32) * qw.scales * row_scale
    y = _block_dot(codes_x, codes_w, qw.scales, accumulate)
    if qw.zeros is not None:
        y = y - _zero_correction(_row_sums(codes_x.astype(jnp.float32), qw.scales.shape[0]), qw)
    return y * row_scale


def _dynamic_blocked(x, qw: QuantizedWeight, codes_w, act_dtype, accumulate, act_blocks: int):
    """Activations quantized per row and block of input features (llama.cpp's Q8_0 x Q8_0 does it per 32):
    an outlier feature costs resolution only in its own block. One partial product per block, each scaled
    by its rows' block scales and the weight's scales of that block, then summed."""
    rows, features = x.shape
    weight_blocks = qw.scales.shape[0]
    if qw.zeros is not None or weight_blocks not in (1, act_blocks):
        raise ValueError(f"activation blocks ({act_blocks}) need per-channel weight scales or as many weight blocks "
                         f"without zero points, got {weight_blocks} blocks")
    xb = x.reshape(rows, act_blocks, features // act_blocks)
    codes_x, x_scale = symmetric_codes(xb, jnp.max(jnp.abs(xb), axis=-1, keepdims=True), QMAX[act_dtype], act_dtype)
    cb = codes_w.reshape(act_blocks, features // act_blocks, -1)
    partial = lax.dot_general(codes_x.swapaxes(0, 1), cb, (((2,), (1,)), ((0,), (0,))),
                              preferred_element_type=accumulate)  # [blocks, M, out]
    scaled = partial.astype(jnp.float32) * x_scale[:, :, 0].T[:, :, None]
    if weight_blocks == 1:
        return scaled.sum(axis=0) * qw.scales
    return jnp.einsum("bmo,bo->mo", scaled, qw.scales)


def quantized_linear(x: jax.Array, qw: QuantizedWeight, strategy: str = "weight_only", *,
                     min_rows: int = 1, act_block_size: int | None = None, codes_out_in: bool = False) -> jax.Array:
    """x [..., in] @ W [in, out] -> [..., out] in x's dtype.

    Args:
      x: activations, any leading shape.
      qw: the weight; `dynamic_int8` needs integer codes (int8, or int4 / uint4 converted exactly),
        `dynamic_fp8` fp8 codes.
      strategy: one of STRATEGIES (`default_strategy` picks one per backend).
      act_block_size: dynamic strategies: one activation scale per row and block of this many input features
        (it must divide them); None: one per row, vLLM's per-token quantization.
      min_rows: pad a batch of fewer rows with zero rows up to this many (static): XLA's CPU backend runs a
        one-row integer dot in slow generated code, a two-row one in its tuned GEMM.
      codes_out_in: the codes are stored transposed, [out, in] (jaxserve/model/feature_major.py: XLA:CPU's
        int8 GEMM ran the 124.7M model's products 1.6-2x faster at 2-16 rows); dynamic strategies with
        per-channel scales, one activation scale per row and no zero points only.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    code_dtype = jnp.dtype(qw.codes.dtype)
    if strategy == "dynamic_int8" and jnp.issubdtype(code_dtype, jnp.floating):
        raise ValueError(f"dynamic_int8 needs integer weight codes, got {code_dtype}")
    if strategy == "dynamic_fp8" and code_dtype != _FP8:
        raise ValueError(f"dynamic_fp8 needs float8_e4m3fn weight codes, got {code_dtype}")
    if codes_out_in and (strategy == "weight_only" or qw.scales.shape[0] != 1 or qw.zeros is not None
                         or act_block_size is not None):
        raise ValueError("codes stored [out, in] need a dynamic strategy, per-channel scales, per-row activation "
                         "scales and no zero points")
    lead, features = x.shape[:-1], x.shape[-1]
    in_features = qw.codes.shape[1 if codes_out_in else 0]
    if features != in_features:
        raise ValueError(f"x has {features} features but the weight takes {in_features}")
    rows = x.reshape(-1, features)
    real = rows.shape[0]
    if real < min_rows:
        rows = jnp.concatenate([rows, jnp.zeros((min_rows - real, features), rows.dtype)])
    if strategy == "weight_only":
        y = _weight_only(rows, qw)
    else:
        act_blocks = 1 if act_block_size is None else features // act_block_size
        if act_block_size is not None and features % act_block_size:
            raise ValueError(f"act_block_size {act_block_size} does not divide {features} input features")
        y = _dynamic(rows, qw, _INT8 if strategy == "dynamic_int8" else _FP8, act_blocks, codes_out_in)
    return y[:real].astype(x.dtype).reshape(*lead, -1)
