"""Quantized linear weights: integer or fp8 codes in our `[in, out]` kernel layout, with float32 scales.

1. `QuantizedWeight` stores W [in, out] as `codes` [in, out] and `scales` [blocks, out]: the input axis is
   cut into `blocks` equal blocks of `in // blocks` rows, each output column has one scale per block. One
   block is per-output-channel quantization; a block of 32 / 64 / 128 rows is the int4 checkpoints' group
   (and the optional block-wise int8 / fp8). Asymmetric int4 (AWQ, GPTQ sym=False) adds `zeros` [blocks,
   out] in code units: W[i, o] = (codes[i, o] - zeros[i // block, o]) * scales[i // block, o].
2. `quantize_weight` makes symmetric codes from a float kernel: scale = absmax / QMAX per (block, column),
   int8 codes round(w / scale) in -127..127, fp8 codes float8_e4m3fn(w / scale), int4 codes in -8..7.
3. `dequantize_weight` is the definition every linear strategy (`linear.py`) and every checkpoint reader
   (`checkpoints.py`) is tested against.
Int4 codes live in JAX's own 4-bit types (`int4`, `uint4` with zeros), which XLA stores two to a byte on
CPU, GPU and TPU and converts with an ordinary `astype`, so no hand-written nibble unpacking runs in a
step (see docs/quantization.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import symmetric_codes

WEIGHT_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn), "int4": jnp.dtype(jnp.int4)}
# Largest code of a symmetric quantizer: int8 keeps -128 unused so the range is symmetric, e4m3fn's largest
# finite value is 448, signed int4 spans -8..7 and scales to 7 (its -8 only ever comes from a checkpoint).
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.int4): 7.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    codes: jax.Array  # [in, out] int8 | float8_e4m3fn | int4 | uint4 (uint4 only with zeros)
    scales: jax.Array  # [blocks, out] float32; blocks == 1: per output channel
    zeros: jax.Array | None = None  # [blocks, out] zero points in code units (asymmetric int4), else None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def block_size(self) -> int:
        """Input rows per scale: the whole input axis for per-channel weights."""
        return self.codes.shape[0] // self.scales.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes on device: 4-bit arrays count half a byte an element (XLA packs them)."""
        return sum(device_bytes(a) for a in (self.codes, self.scales, self.zeros) if a is not None)


def device_bytes(a) -> int:
    """Bytes of an array on device: 4-bit arrays count half a byte an element (XLA packs them)."""
    if a.dtype in (jnp.int4, jnp.uint4):
        return (a.size + 1) // 2
    return a.size * a.dtype.itemsize


def check_quantized_weight(qw: QuantizedWeight, name: str = "weight") -> QuantizedWeight:
    """Shape and dtype checks (ValueError naming `name`); not in __post_init__, since JAX rebuilds pytrees
    with placeholder leaves (vmap axes, shape structs) that must pass through unchecked."""
    codes, scales = qw.codes, qw.scales
    if codes.ndim != 2 or scales.ndim != 2 or scales.shape[1] != codes.shape[1]:
        raise ValueError(f"{name}: codes must be [in, out] and scales [blocks, out], got {codes.shape} and "
                         f"{scales.shape}")
    if codes.shape[0] % scales.shape[0]:
        raise ValueError(f"{name}: {scales.shape[0]} scale blocks do not divide the {codes.shape[0]} input rows")
    if codes.dtype not in (*QMAX, jnp.dtype(jnp.uint4)):
        raise ValueError(f"{name}: codes must be int8, float8_e4m3fn, int4 or uint4, got {codes.dtype}")
    if (qw.zeros is not None) != (codes.dtype == jnp.uint4):
        raise ValueError(f"{name}: uint4 codes need zero points and only they take them")
    if qw.zeros is not None and qw.zeros.shape != scales.shape:
        raise ValueError(f"{name}: zeros must be [blocks, out]={scales.shape}, got {qw.zeros.shape}")
    return qw


def quantize_weight(w, dtype: str = "int8", block_size: int | None = None) -> QuantizedWeight:
    """Symmetric quantization of a float kernel w [in, out]: one scale per output column, or per block of
    `block_size` input rows and output column (which must divide `in`)."""
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight quantization dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
    w = jnp.asarray(w, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"a linear kernel is [in, out], got shape {w.shape}")
    rows, cols = w.shape
    block = rows if block_size is None else block_size
    if block < 1 or rows % block:
        raise ValueError(f"block_size {block_size} must divide the {rows} input rows")
    code_dtype = WEIGHT_DTYPES[dtype]
    qmax = QMAX[code_dtype]
    blocks = w.reshape(rows // block, block, cols)
    codes, scales = symmetric_codes(blocks, jnp.max(jnp.abs(blocks), axis=1, keepdims=True), qmax, code_dtype)
    return check_quantized_weight(QuantizedWeight(codes.reshape(rows, cols), scales[:, 0].astype(jnp.float32)))


def dequantize_weight(qw: QuantizedWeight) -> jax.Array:
    """The float32 kernel [in, out] the codes stand for."""
    rows, cols = qw.shape
    blocks = qw.scales.shape[0]
    codes = qw.codes.astype(jnp.float32).reshape(blocks, rows // blocks, cols)
    if qw.zeros is not None:
        codes = codes - qw.zeros.astype(jnp.float32)[:, None, :]
    return (codes * qw.scales.astype(jnp.float32)[:, None, :]).reshape(rows, cols)
