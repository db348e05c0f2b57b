"""The page write (`pallas_kernels/page_write.py`): both scatter forms write the same tokens, and each
platform's program gets its own form.

1. `head_windows` (TPU) and `token_windows` (CPU, GPU) leave the same pages and lane-dense scales as a
   numpy write token by token, for float32 / bf16 / int8 pages, page sizes below and above the 128 lanes of
   a scale row, slots on several pages, and nothing else changed.
2. `write_token_rows` lowers to the one-head window for a TPU and to the token window for a CPU and a GPU
   (read from the lowered programs' scatter; no device needed).
3. `write_kv` through the engine's entry point (float pages, and quantized pages with their scales) is
   what the numpy write gives.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.kv_cache import QuantizedPages, write_kv
from pallas_kernels.kv_quant import SCALE_LANES, dequantize_kv, page_scales, scales_shape
from pallas_kernels.page_write import head_windows, token_windows, write_token_rows

RNG = np.random.default_rng(3)
FORMS = {"head_windows": head_windows, "token_windows": token_windows}


def numpy_write(pages: np.ndarray, slots: np.ndarray, rows: np.ndarray, per_row: int) -> np.ndarray:
    """The oracle: token t's head h at [h, slot // per_row, slot % per_row] (pages: per_row = page_size)."""
    out = pages.copy()
    for t, slot in enumerate(slots):
        out[:, slot // per_row, slot % per_row] = rows[t]
    return out


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("dtype,page_size", [("float32", 4), ("bfloat16", 16), ("int8", 256)])
def test_both_forms_write_the_tokens_at_their_slots(form, dtype, page_size):
    kvh, num_pages, head_dim = 3, 7, 8
    pages = RNG.standard_normal((kvh, num_pages, page_size, head_dim)).astype(dtype)
    slots = RNG.permutation(num_pages * page_size)[:9].astype(np.int32)  # distinct, over several pages
    rows = RNG.standard_normal((9, kvh, head_dim)).astype(dtype)
    got = jax.jit(FORMS[form])(jnp.asarray(pages), jnp.asarray(slots), jnp.asarray(rows))
    np.testing.assert_array_equal(np.asarray(got), numpy_write(pages, slots, rows, page_size))

    scales = RNG.uniform(size=scales_shape(kvh, num_pages, page_size)).astype(np.float32)
    token_scales = RNG.uniform(size=(9, kvh)).astype(np.float32)
    got = jax.jit(FORMS[form])(jnp.asarray(scales), jnp.asarray(slots), jnp.asarray(token_scales))
    np.testing.assert_array_equal(np.asarray(got), numpy_write(scales, slots, token_scales, SCALE_LANES))


@pytest.mark.parametrize("platform,form", [("tpu", "head"), ("cpu", "token"), ("cuda", "token")])
def test_each_platform_lowers_its_own_form(platform, form):
    pages = jax.ShapeDtypeStruct((8, 65, 16, 128), jnp.bfloat16)
    args = (pages, jax.ShapeDtypeStruct((32,), jnp.int32), jax.ShapeDtypeStruct((32, 8, 128), jnp.bfloat16))
    text = jax.jit(write_token_rows).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    scatters = re.findall(r"stablehlo\.scatter.*?update_window_dims = \[([\d, ]*)\]", text, re.S)
    # One window dimension (head_dim) for a TPU; two (heads, head_dim of the flat view) elsewhere.
    assert len(scatters) == 1 and len(scatters[0].split(",")) == (1 if form == "head" else 2), scatters


def test_write_kv_writes_float_and_quantized_pages():
    kvh, num_pages, page_size, head_dim = 2, 5, 4, 16
    shape = (kvh, num_pages, page_size, head_dim)
    slots = np.array([5, 6, 17, 0], np.int32)  # pages 1 and 4, and the null page's first slot
    k, v = (RNG.standard_normal((4, kvh, head_dim)).astype(np.float32) for _ in range(2))
    zeros = jnp.zeros(shape, jnp.float32)
    kf, vf = jax.jit(write_kv)(zeros, zeros, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(kf), numpy_write(np.zeros(shape, np.float32), slots, k, page_size))
    np.testing.assert_array_equal(np.asarray(vf), numpy_write(np.zeros(shape, np.float32), slots, v, page_size))

    empty = QuantizedPages(jnp.zeros(shape, jnp.int8), jnp.zeros(scales_shape(*shape[:3]), jnp.float32))
    kq, _ = jax.jit(write_kv)(empty, empty, jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    ids = jnp.arange(num_pages)
    dequantized = dequantize_kv(kq.codes, page_scales(kq.scales, ids, page_size))
    want = numpy_write(np.zeros(shape, np.float32), slots, k, page_size)
    np.testing.assert_allclose(np.asarray(dequantized), want, atol=np.abs(k).max() / 127)
