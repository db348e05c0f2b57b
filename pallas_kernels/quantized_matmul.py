"""Weight-only quantized matrix products for decode-shaped batches: the contract, the reference, and the
per-step math the Triton and Mosaic kernels share.

`y [M, N] = x [M, K] @ W` with W held as `QuantizedLinear` holds it (jaxserve/quantization/weights.py):
codes [K, N] int8, int4 or uint4 (4-bit arrays are packed two to a byte by XLA; the kernels read them so),
float32 scales [G, N] (G = 1: one per output channel; else one per group of K / G input rows), and for
uint4 codes int8 zero points [G, N]: W[k, n] = (codes[k, n] - zeros[k // group, n]) * scales[k // group, n].
1. `check_quantized_matmul_args` holds every implementation to that contract (ValueError naming the input).
2. `quantized_matmul_reference` dequantizes W in float32 and runs one product: the definition of correct.
3. Both kernels walk K in steps of `block_k` rows. A step covers one scale row (block_k divides the group) or
   several whole groups (the group divides block_k): `scale_rows` says how many, and `scale_blocks` lays the
   scales out [steps' worth of groups, rows per step, N] so a step's rows are one block of the array.
4. `step_operand` is a step's dequantization, in registers (Triton) or VMEM (Mosaic): with one scale row the
   integer codes (less the zero points) convert exactly to x's dtype and the scale multiplies the step's
   float32 product; over several groups each row is scaled before the product (in x's dtype: bf16 rounds the
   weights there, float32 keeps them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_ROWS = 64  # decode-shaped batches: the kernels are written (and their tiles chosen) for 1..64 rows
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.int4), jnp.dtype(jnp.uint4))
X_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_quantized_matmul_args(x: jax.Array, codes: jax.Array, scales: jax.Array, zeros: jax.Array | None) -> None:
    """The contract every implementation shares; a ValueError names the bad input."""
    if x.ndim != 2 or jnp.dtype(x.dtype) not in X_DTYPES:
        raise ValueError(f"x must be [rows, K] float32, bfloat16 or float16, got {x.dtype} {x.shape}")
    if codes.ndim != 2 or jnp.dtype(codes.dtype) not in CODE_DTYPES:
        raise ValueError(f"codes must be [K, N] int8, int4 or uint4, got {codes.dtype} {codes.shape}")
    if x.shape[1] != codes.shape[0]:
        raise ValueError(f"x has {x.shape[1]} features but the codes take {codes.shape[0]}")
    if scales.ndim != 2 or scales.shape[1] != codes.shape[1] or jnp.dtype(scales.dtype) != jnp.float32:
        raise ValueError(f"scales must be float32 [groups, N={codes.shape[1]}], got {scales.dtype} {scales.shape}")
    if codes.shape[0] % scales.shape[0]:
        raise ValueError(f"{scales.shape[0]} scale groups do not divide the {codes.shape[0]} input rows")
    if (zeros is not None) != (jnp.dtype(codes.dtype) == jnp.uint4):
        raise ValueError("uint4 codes need zero points and only they take them")
    if zeros is not None and (zeros.shape != scales.shape or jnp.dtype(zeros.dtype) != jnp.int8):
        raise ValueError(f"zeros must be int8 {scales.shape} like the scales, got {zeros.dtype} {zeros.shape}")


def quantized_matmul_reference(x: jax.Array, codes: jax.Array, scales: jax.Array,
                               zeros: jax.Array | None = None) -> jax.Array:
    """x [M, K] @ dequantized W [K, N] -> [M, N] in x's dtype, in float32 throughout.

    Args:
      x: activations [M, K], float32, bfloat16 or float16.
      codes: [K, N] int8, int4, or uint4 (with `zeros`).
      scales: float32 [G, N]: one scale per output column and group of K / G input rows.
      zeros: int8 [G, N] zero points in code units (uint4 codes only), else None.
    """
    check_quantized_matmul_args(x, codes, scales, zeros)
    (k, n), groups = codes.shape, scales.shape[0]
    w = codes.astype(jnp.float32).reshape(groups, k // groups, n)
    if zeros is not None:
        w = w - zeros.astype(jnp.float32)[:, None, :]
    w = (w * scales[:, None, :]).reshape(k, n)
    y = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def code_bytes(dtype) -> float:
    """Bytes one code takes in HBM: 4-bit codes are packed two to a byte."""
    return jnp.iinfo(dtype).bits / 8


def scale_rows(block_k: int, group: int, features: int) -> int:
    """Scale rows one K step of `block_k` rows spans: 1 when it lies inside one group (per-channel scales:
    always, a K tail included), else its groups. Raises ValueError when neither divides the other (a step
    would straddle a group's edge)."""
    if group == features or group % block_k == 0:
        return 1
    if block_k % group == 0:
        return block_k // group
    raise ValueError(f"block_k {block_k} and the scale group of {group} rows must divide one another")


def scale_blocks(a: jax.Array, rows: int) -> jax.Array:
    """scales or zeros [G, N] -> [G / rows, rows, N]: block t of the leading axis holds the rows of K step t
    (`rows` > 1), or of every step inside group t (`rows` == 1). A reshape XLA does without a copy."""
    return a.reshape(a.shape[0] // rows, rows, a.shape[1])


def step_block(step, block_k: int, group: int, rows: int):
    """Index along `scale_blocks`' leading axis of K step `step` (traced or static)."""
    return step * block_k // (rows * group)


def step_operand(codes, scales, zeros, dtype):
    """One K step's weights for the product, and what multiplies the product after it.

    codes [block_k, block_n]; scales [r, block_n] float32 and zeros [r, block_n] (or None): the step's r
    scale rows. r == 1: ((codes - zeros) in `dtype`, exact for 8-bit and 4-bit codes, and scales [1, block_n]
    for the float32 product); r > 1: ((codes - zeros) * scales in `dtype`, None), each group's rows scaled.
    """
    r = scales.shape[0]
    if r == 1:
        if zeros is None:
            return codes.astype(dtype), scales
        return (codes.astype(jnp.float32) - zeros.astype(jnp.float32)).astype(dtype), scales
    block_k, block_n = codes.shape

    def expand(a):  # [r, block_n] -> [block_k, block_n], each row repeated over its group
        return jnp.broadcast_to(a[:, None, :], (r, block_k // r, block_n)).reshape(block_k, block_n)

    w = codes.astype(jnp.float32)
    if zeros is not None:
        w = w - expand(zeros.astype(jnp.float32))
    return (w * expand(scales)).astype(dtype), None
