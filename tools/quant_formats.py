"""Int4 weight formats of AutoAWQ (GEMM) and GPTQ (checkpoint_format "gptq"), in numpy, written from the specs.

Both store a linear layer W [out, in] transposed, as integer codes q in 0..15 per (in, out) element, with
one fp16 scale and one zero point per (group of `group_size` input rows, output column):

    W.T[i, o] = (q[i, o] - zero[i // group_size, o]) * scale[i // group_size, o]

They differ in how codes are packed into int32 words (8 nibbles, nibble k at bits 4k..4k+3):

- AWQ GEMM: `qweight` int32 [in, out / 8] and `qzeros` int32 [in / group, out / 8] pack along the output
  axis in AutoAWQ's interleaved order: nibble k of word c holds column 8c + AWQ_ORDER[k].
- GPTQ: `qweight` int32 [in / 8, out] packs along the input axis (nibble k of row r holds input row
  8r + k); `qzeros` int32 [in / group, out / 8] packs along the output axis in plain order and stores
  zero - 1 (the "v1" format: readers add 1 back); `g_idx` int32 [in] gives each input row its group
  (i // group_size when desc_act is false). Symmetric 4-bit GPTQ has zero 8 everywhere, so every qzeros
  word is 0x77777777.

`quantize_rtn` produces codes by round-to-nearest (the formats do not care how codes were chosen), the
pack/unpack pairs are exact inverses, and the `dequantize_*` readers are what a loader must implement.
"""

from __future__ import annotations

import numpy as np

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset stored in nibble k of an AWQ word
NIBBLES = 8
MAXQ = 15


def _pack_last_axis(codes: np.ndarray, order) -> np.ndarray:
    """Pack codes [..., n] into int32 [..., n / 8]; nibble k of word c holds codes[..., 8c + order[k]]."""
    assert codes.shape[-1] % NIBBLES == 0 and codes.min() >= 0 and codes.max() <= MAXQ
    grouped = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, NIBBLES)[..., list(order)]
    words = np.zeros(grouped.shape[:-1], dtype=np.uint32)
    for k in range(NIBBLES):
        words |= grouped[..., k] << np.uint32(4 * k)
    return words.view(np.int32)


def _unpack_last_axis(words: np.ndarray, order) -> np.ndarray:
    """Inverse of _pack_last_axis: int32 [..., m] -> codes uint8 [..., 8m]."""
    w = words.astype(np.int32).view(np.uint32)
    nibbles = np.stack([(w >> np.uint32(4 * k)) & np.uint32(0xF) for k in range(NIBBLES)], axis=-1)
    codes = np.empty_like(nibbles)
    codes[..., list(order)] = nibbles  # nibble k goes back to column offset order[k]
    return codes.reshape(*w.shape[:-1], -1).astype(np.uint8)


def pack_awq(codes: np.ndarray) -> np.ndarray:
    return _pack_last_axis(codes, AWQ_ORDER)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    return _unpack_last_axis(words, AWQ_ORDER)


def pack_gptq_qweight(codes: np.ndarray) -> np.ndarray:
    """codes [in, out] -> int32 [in / 8, out], packed along the input axis."""
    return np.ascontiguousarray(_pack_last_axis(codes.T, range(NIBBLES)).T)


def unpack_gptq_qweight(words: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(_unpack_last_axis(np.ascontiguousarray(words.T), range(NIBBLES)).T)


def pack_gptq_qzeros(zeros: np.ndarray) -> np.ndarray:
    """zeros [groups, out] in 1..15 -> int32 [groups, out / 8] holding zero - 1 (v1 format)."""
    assert zeros.min() >= 1, "GPTQ v1 stores zero - 1: a zero point of 0 cannot be represented"
    return _pack_last_axis(zeros.astype(np.int64) - 1, range(NIBBLES))


def unpack_gptq_qzeros(words: np.ndarray) -> np.ndarray:
    return _unpack_last_axis(words, range(NIBBLES)).astype(np.int64) + 1


def quantize_rtn(w: np.ndarray, group_size: int, symmetric: bool):
    """Round-to-nearest 4-bit group quantization of W [out, in].

    Returns codes uint8 [in, out], zeros int64 [in / group, out] and fp16 scales [in / group, out].
    Scales are rounded to fp16 before the codes are computed, so the stored scales are exact.
    Asymmetric: scale = (max - min) / 15, zero = round(-min / scale) (AutoAWQ and GPTQ's asym rule);
    symmetric (GPTQ): scale = 2 * absmax / 15, zero = 8.
    """
    out_f, in_f = w.shape
    g = w.T.reshape(in_f // group_size, group_size, out_f).astype(np.float64)
    lo, hi = np.minimum(g.min(axis=1), 0.0), np.maximum(g.max(axis=1), 0.0)
    if symmetric:
        scale = np.maximum(np.maximum(-lo, hi) * 2 / MAXQ, 1e-5)
        zeros = np.full(scale.shape, (MAXQ + 1) // 2, dtype=np.int64)
    else:
        scale = np.maximum((hi - lo) / MAXQ, 1e-5)
        zeros = np.clip(np.round(-lo / scale), 0, MAXQ).astype(np.int64)
    scale16 = np.ascontiguousarray(scale.astype(np.float16))  # g.min(axis=1) leaves a strided layout
    s = scale16.astype(np.float64)[:, None, :]
    codes = np.clip(np.round(g / s) + zeros[:, None, :], 0, MAXQ)
    return codes.reshape(in_f, out_f).astype(np.uint8), np.ascontiguousarray(zeros), scale16


def dequantize_groups(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """W [out, in] float32 from codes [in, out], per-group zeros / scales and each input row's group."""
    q = codes.astype(np.float32) - zeros[g_idx].astype(np.float32)
    return np.ascontiguousarray((q * scales[g_idx].astype(np.float32)).T)


def dequantize_awq(qweight, qzeros, scales, group_size: int) -> np.ndarray:
    g_idx = np.arange(qweight.shape[0]) // group_size
    return dequantize_groups(unpack_awq(qweight), unpack_awq(qzeros), scales, g_idx)


def dequantize_gptq(qweight, qzeros, scales, g_idx) -> np.ndarray:
    return dequantize_groups(unpack_gptq_qweight(qweight), unpack_gptq_qzeros(qzeros), scales, g_idx)


def awq_tensors(w: np.ndarray, group_size: int):
    """AutoAWQ GEMM tensors of W [out, in] and the dequantized weight they encode."""
    codes, zeros, scales = quantize_rtn(w, group_size, symmetric=False)
    w_dq = dequantize_groups(codes, zeros, scales, np.arange(w.shape[1]) // group_size)
    return {"qweight": pack_awq(codes), "qzeros": pack_awq(zeros), "scales": scales}, w_dq


def gptq_tensors(w: np.ndarray, group_size: int, symmetric: bool):
    """GPTQ v1 tensors of W [out, in] (desc_act false) and the dequantized weight they encode."""
    codes, zeros, scales = quantize_rtn(w, group_size, symmetric)
    g_idx = (np.arange(w.shape[1]) // group_size).astype(np.int32)
    w_dq = dequantize_groups(codes, zeros, scales, g_idx)
    return {"qweight": pack_gptq_qweight(codes), "qzeros": pack_gptq_qzeros(zeros), "scales": scales,
            "g_idx": g_idx}, w_dq


def nibble(word: int, k: int) -> int:
    """Bits 4k..4k+3 of a stored int32 word (the spec, one scalar at a time, for spot checks)."""
    return (int(word) & 0xFFFFFFFF) >> (4 * k) & 0xF
