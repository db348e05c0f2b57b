"""4-bit codes packed eight to an int32 word, as AutoAWQ and GPTQ store them, unpacked on the host at load.

Nibble k of a word sits at bits 4k..4k+3. The formats differ in which element nibble k is:
1. AWQ GEMM packs along the output axis in an interleaved order: nibble k of word c is column
   8c + AWQ_ORDER[k] (`qweight` [in, out / 8] and `qzeros` [groups, out / 8]).
2. GPTQ packs `qweight` along the input axis (nibble k of word row r is input row 8r + k, [in / 8, out])
   and `qzeros` along the output axis in plain order (nibble k of word c is column 8c + k).
Unpacked codes are uint8 in 0..15; the readers turn them into JAX's 4-bit types, which XLA packs again on
the device (two per byte) in its own layout.
"""

from __future__ import annotations

import numpy as np

NIBBLES_PER_WORD = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column offset nibble k of an AWQ word holds
PLAIN_ORDER = tuple(range(NIBBLES_PER_WORD))
_SHIFTS = np.arange(NIBBLES_PER_WORD, dtype=np.uint32) * 4


def unpack_columns(words: np.ndarray, order=PLAIN_ORDER) -> np.ndarray:
    """int32 words [rows, cols / 8] -> uint8 codes [rows, cols]; nibble k of word c is column 8c + order[k]."""
    if words.dtype != np.int32 or words.ndim != 2:
        raise ValueError(f"packed 4-bit codes must be a 2-D int32 array, got {words.dtype} {words.shape}")
    nibbles = (words.view(np.uint32)[:, :, None] >> _SHIFTS) & np.uint32(0xF)  # [rows, words, nibble k]
    codes = np.empty_like(nibbles, dtype=np.uint8)
    codes[:, :, list(order)] = nibbles  # nibble k lands at offset order[k] within its word's 8 columns
    return codes.reshape(words.shape[0], -1)


def unpack_rows(words: np.ndarray) -> np.ndarray:
    """int32 words [rows / 8, cols] -> uint8 codes [rows, cols]; nibble k of word row r is row 8r + k."""
    return np.ascontiguousarray(unpack_columns(np.ascontiguousarray(words.T)).T)
