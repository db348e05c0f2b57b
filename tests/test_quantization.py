"""Weight quantization primitives and the quantize-on-write KV helper (`jaxserve.quantization`).

1. `quantize_weight` / `dequantize_weight`: each element's error is within half a quantization step
   (int8 / int4) or e4m3's relative rounding (fp8), per channel and per block, without NaNs.
2. `quantized_linear`: weight-only equals x @ dequantized W to float rounding; the dynamic strategies
   equal a numpy formulation of per-row activation quantization (vLLM's rule) and stay within the
   expected error of the float product; zero points, block scales, padding of one row, bf16 inputs.
3. `write_kv_quantized`: codes and scales land at the flat slots (the scales lane-dense, 128 a row),
   nothing else changes, and attention over the written pages matches attention over float pages
   written by `write_kv`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.model.kv_cache import write_kv
from jaxserve.quantization import (
    QuantizedWeight,
    default_strategy,
    dequantize_weight,
    kv_token_bytes,
    quantize_weight,
    quantized_linear,
    write_kv_quantized,
)
from pallas_kernels.blocked import ragged_paged_attention_blocked
from pallas_kernels.kv_quant import dequantize_kv, kv_quant_dtype, scales_shape
from pallas_kernels.testing import KV_QUANT_TOLERANCES

RNG = np.random.default_rng(7)
W = (RNG.standard_normal((128, 48)) * 0.05).astype(np.float32)
W[:, 5] = 0.0  # an all-zero column: scale 0, codes 0, no NaN
X = RNG.standard_normal((3, 128)).astype(np.float32)


@pytest.mark.parametrize("block_size", [None, 32])
@pytest.mark.parametrize("dtype", ["int8", "fp8", "int4"])
def test_round_trip_error_is_within_one_rounding(dtype, block_size):
    qw = quantize_weight(W, dtype, block_size)
    blocks = 1 if block_size is None else 128 // block_size
    assert qw.codes.shape == W.shape and qw.scales.shape == (blocks, 48) and qw.block_size == 128 // blocks
    err = np.abs(np.asarray(dequantize_weight(qw)) - W)
    step = np.repeat(np.asarray(qw.scales), 128 // blocks, axis=0)  # [in, out] scale of each element
    if dtype == "fp8":  # 3 mantissa bits: relative half-ulp 2^-4; subnormals have absolute steps of 2^-9
        bound = np.maximum(np.abs(W) / 16, step * 2.0 ** -10)
    else:
        bound = step / 2
    assert np.all(err <= bound * (1 + 1e-5) + 1e-9)
    assert np.all(np.isfinite(np.asarray(dequantize_weight(qw)))) and float(qw.scales[0, 5]) == 0.0
    # The largest element of each column uses the top code.
    top = {"int8": 127, "fp8": 448, "int4": 7}[dtype]
    assert np.abs(np.asarray(qw.codes.astype(jnp.float32))).max() == top


def test_requantizing_dequantized_int8_weights_is_exact():
    qw = quantize_weight(W, "int8")
    again = quantize_weight(dequantize_weight(qw), "int8")
    np.testing.assert_array_equal(np.asarray(again.codes), np.asarray(qw.codes))


def test_int4_codes_are_packed_on_device():
    qw = quantize_weight(np.ones((256, 256), np.float32), "int4")
    assert qw.nbytes == 256 * 256 // 2 + 256 * 4
    assert qw.codes.addressable_data(0).on_device_size_in_bytes() == 256 * 256 // 2
    assert _asymmetric_int4().nbytes == 128 * 48 // 2 + 4 * 48 * 4 + 4 * 48  # codes, scales, int8 zeros


def _asymmetric_int4(block: int = 32) -> QuantizedWeight:
    """uint4 codes with zero points, as the AWQ / GPTQ asym readers produce them."""
    codes = RNG.integers(0, 16, size=(128, 48))
    zeros = RNG.integers(1, 16, size=(128 // block, 48))
    scales = RNG.uniform(0.001, 0.02, size=(128 // block, 48)).astype(np.float32)
    return QuantizedWeight(jnp.asarray(codes, jnp.uint4), jnp.asarray(scales), jnp.asarray(zeros, jnp.int8))


def _weights():
    out = {f"{d}-{'block' if b else 'channel'}": quantize_weight(W, d, b) for d in ("int8", "fp8", "int4")
           for b in (None, 32)}
    out["uint4-zeros"] = _asymmetric_int4()
    return out


WEIGHTS = _weights()


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_weight_only_equals_the_dequantized_matmul(name):
    qw = WEIGHTS[name]
    want = X.astype(np.float64) @ np.asarray(dequantize_weight(qw), np.float64)
    got = np.asarray(jax.jit(quantized_linear, static_argnames="strategy")(jnp.asarray(X), qw, "weight_only"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _numpy_dynamic(x: np.ndarray, qw: QuantizedWeight, act: str, block: int | None = None) -> np.ndarray:
    """Per-row activation quantization as vLLM does it (or per row and block of `block` features, as
    llama.cpp's Q8_0 does per 32), then the float64 product with the dequantized W."""
    if block is not None:
        rows, features = x.shape
        xq = _numpy_dynamic(x.reshape(rows * features // block, block), None, act).reshape(rows, features)
        return xq @ np.asarray(dequantize_weight(qw), np.float64)
    absmax = np.abs(x).max(axis=1, keepdims=True)
    if act == "int8":
        codes = np.clip(np.round(x * (127 / absmax)), -127, 127)  # np.round is half-to-even too
        xq = codes * absmax / 127
    else:
        codes = np.clip(x * (448 / absmax), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        xq = codes * absmax / 448
    return xq if qw is None else xq @ np.asarray(dequantize_weight(qw), np.float64)


@pytest.mark.parametrize("name", ["int8-channel", "int8-block", "fp8-channel"])
def test_dynamic_with_activation_blocks_matches_per_block_quantization(name):
    qw = WEIGHTS[name]
    act = "fp8" if name.startswith("fp8") else "int8"
    block = 128 // qw.scales.shape[0] if qw.scales.shape[0] > 1 else 32  # block weights: the same blocks
    got = np.asarray(quantized_linear(jnp.asarray(X), qw, f"dynamic_{act}", act_block_size=block))
    want = _numpy_dynamic(X, qw, act, block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # Finer activation scales are closer to the float product than one scale per row.
    per_row = np.asarray(quantized_linear(jnp.asarray(X), qw, f"dynamic_{act}"))
    exact = X @ np.asarray(dequantize_weight(qw), np.float64)
    assert np.abs(got - exact).mean() < np.abs(per_row - exact).mean()
    with pytest.raises(ValueError, match="does not divide"):
        quantized_linear(jnp.asarray(X), qw, f"dynamic_{act}", act_block_size=48)


@pytest.mark.parametrize("name", [n for n in sorted(WEIGHTS) if not n.startswith("fp8")])
def test_dynamic_int8_matches_per_row_activation_quantization(name):
    qw = WEIGHTS[name]
    got = np.asarray(quantized_linear(jnp.asarray(X), qw, "dynamic_int8"))
    want = _numpy_dynamic(X, qw, "int8")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", ["fp8-channel", "fp8-block"])
def test_dynamic_fp8_matches_per_row_activation_quantization(name):
    qw = WEIGHTS[name]
    got = np.asarray(quantized_linear(jnp.asarray(X), qw, "dynamic_fp8"))
    want = _numpy_dynamic(X, qw, "fp8")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# Relative error (max |diff| / max |x @ W|) against the float product; measured 0.005-0.012 (int8),
# 0.024-0.046 (fp8), 0.10-0.16 (int4, 4 bits over a 0.05-wide normal).
EXPECTED_ERROR = {("int8", "weight_only"): 0.02, ("int8", "dynamic_int8"): 0.03, ("fp8", "weight_only"): 0.06,
                  ("fp8", "dynamic_fp8"): 0.08, ("int4", "weight_only"): 0.25, ("int4", "dynamic_int8"): 0.25}


@pytest.mark.parametrize("dtype,strategy", sorted(EXPECTED_ERROR))
def test_quantized_linear_stays_near_float(dtype, strategy):
    want = X @ W
    for block in (None, 32):
        got = np.asarray(quantized_linear(jnp.asarray(X), quantize_weight(W, dtype, block), strategy))
        assert np.abs(got - want).max() / np.abs(want).max() <= EXPECTED_ERROR[dtype, strategy]


@pytest.mark.parametrize("strategy", ["weight_only", "dynamic_int8"])
def test_one_padded_row_and_leading_axes_give_the_same_result(strategy):
    qw = WEIGHTS["int8-channel"]
    x = jnp.asarray(X)
    one = quantized_linear(x[:1], qw, strategy)
    for min_rows in (2, 4):  # to the last bit or two: XLA compiles the scaling for each shape on its own
        np.testing.assert_allclose(np.asarray(quantized_linear(x[:1], qw, strategy, min_rows=min_rows)),
                                   np.asarray(one), rtol=1e-6, atol=1e-7)
    batched = quantized_linear(x.reshape(3, 1, 128), qw, strategy)
    assert batched.shape == (3, 1, 48)
    np.testing.assert_allclose(np.asarray(batched[:, 0]), np.asarray(quantized_linear(x, qw, strategy)), rtol=1e-6)


def test_bfloat16_activations_come_back_in_bfloat16():
    y = quantized_linear(jnp.asarray(X, jnp.bfloat16), WEIGHTS["int8-channel"], "weight_only")
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), X @ W, atol=0.03 * np.abs(X @ W).max())


def test_bad_arguments_are_named():
    qw = WEIGHTS["int8-channel"]
    with pytest.raises(ValueError, match="strategy must be one of"):
        quantized_linear(jnp.asarray(X), qw, "fastest")
    with pytest.raises(ValueError, match="dynamic_int8 needs integer"):
        quantized_linear(jnp.asarray(X), WEIGHTS["fp8-channel"], "dynamic_int8")
    with pytest.raises(ValueError, match="dynamic_fp8 needs float8"):
        quantized_linear(jnp.asarray(X), qw, "dynamic_fp8")
    with pytest.raises(ValueError, match="features"):
        quantized_linear(jnp.asarray(X[:, :64]), qw)
    with pytest.raises(ValueError, match="block_size 48 must divide"):
        quantize_weight(W, "int8", 48)
    with pytest.raises(ValueError, match="must be one of"):
        quantize_weight(W, "int2")


def test_default_strategy_per_backend():
    assert default_strategy("cpu", jnp.int8) == "dynamic_int8"
    assert default_strategy("tpu", jnp.int8) == "dynamic_int8"
    assert default_strategy("gpu", jnp.int8) == "weight_only"  # decode is bytes there; the Pallas kernel may run it
    assert default_strategy("cuda", jnp.float8_e4m3fn) == "dynamic_fp8"
    assert default_strategy("cpu", jnp.float8_e4m3fn) == "weight_only"
    assert default_strategy("tpu", jnp.float8_e4m3fn) == "weight_only"
    assert default_strategy("gpu", jnp.int4) == "weight_only"


# ---- the KV write side ----------------------------------------------------------------------------------

def _float_and_quantized_pages(kv_dtype: str, kvh=2, pages=6, page_size=4, head_dim=16):
    shape = (kvh, pages, page_size, head_dim)
    dtype = kv_quant_dtype(kv_dtype)
    zeros_f = jnp.zeros(shape, jnp.float32)
    zeros_q = jnp.zeros(shape, dtype)
    scales = jnp.zeros(scales_shape(*shape[:3]), jnp.float32)
    return (zeros_f, zeros_f), (zeros_q, zeros_q, scales, scales)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_write_kv_quantized_writes_codes_and_scales_at_the_slots(kv_dtype):
    _, (k_pages, v_pages, k_scales, v_scales) = _float_and_quantized_pages(kv_dtype)
    k = jnp.asarray(RNG.standard_normal((3, 2, 16)), jnp.float32)
    v = jnp.asarray(RNG.standard_normal((3, 2, 16)), jnp.float32) * 10
    slots = jnp.array([5, 6, 21])  # page 1 offsets 1 and 2, page 5 offset 1
    k_pages, v_pages, k_scales, v_scales = jax.jit(write_kv_quantized)(k_pages, v_pages, k_scales, v_scales, k, v,
                                                                     slots)
    assert k_pages.dtype == kv_quant_dtype(kv_dtype)
    flat = lambda a: np.asarray(a).reshape(2, -1, *a.shape[3:])[:, :24]  # noqa: E731 (scales: 128 a row)
    for pages, scales, new in ((k_pages, k_scales, k), (v_pages, v_scales, v)):
        got = np.asarray(dequantize_kv(jnp.asarray(flat(pages)[:, slots]), jnp.asarray(flat(scales)[:, slots])))
        want = np.asarray(new).transpose(1, 0, 2)
        step = np.abs(want).max(axis=-1, keepdims=True) / (127 if kv_dtype == "int8" else 448)
        bound = step / 2 if kv_dtype == "int8" else np.maximum(np.abs(want) / 16, step * 2.0 ** -9)
        assert np.all(np.abs(got - want) <= bound * (1 + 1e-5))
        others = np.setdiff1d(np.arange(24), np.asarray(slots))
        assert not np.asarray(flat(pages)[:, others].astype(np.float32)).any() and not flat(scales)[:, others].any()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_attention_over_written_pages_matches_float_pages(kv_dtype):
    """Two sequences written token by token (padding to the null page), then attended: the quantized write
    and read sides agree with the float ones within the kernel sweep's tolerance."""
    (kf, vf), (kq, vq, ks, vs) = _float_and_quantized_pages(kv_dtype, pages=7)
    tables = jnp.array([[3, 1, 0], [2, 6, 5]], jnp.int32)
    kv_lens = np.array([6, 10])
    for t in range(10):
        live = t < kv_lens
        slots = jnp.asarray(np.where(live, np.asarray(tables)[:, min(t // 4, 2)] * 4 + t % 4, 0))  # dead: null
        k = jnp.asarray(RNG.standard_normal((2, 2, 16)), jnp.float32)
        v = jnp.asarray(RNG.standard_normal((2, 2, 16)), jnp.float32)
        kf, vf = write_kv(kf, vf, k, v, slots)
        kq, vq, ks, vs = write_kv_quantized(kq, vq, ks, vs, k, v, slots)
    q = jnp.asarray(RNG.standard_normal((4, 4, 16)), jnp.float32)
    args = (jnp.asarray(kv_lens, jnp.int32), tables, jnp.array([0, 1, 4], jnp.int32))
    want = ragged_paged_attention_blocked(q, kf, vf, *args, sm_scale=0.25)
    got = ragged_paged_attention_blocked(q, kq, vq, *args, sm_scale=0.25, k_scales=ks, v_scales=vs)
    max_tol, rms_tol = KV_QUANT_TOLERANCES[kv_dtype]
    diff = np.asarray(got - want)
    assert np.abs(diff).max() <= max_tol and np.sqrt(np.mean(diff ** 2)) <= rms_tol


def test_kv_token_bytes_count_the_scales():
    assert kv_token_bytes(4, 64, jnp.float32) == 2 * 4 * 64 * 4
    assert kv_token_bytes(4, 64, kv_quant_dtype("int8")) == 2 * 4 * (64 + 4)
    assert kv_token_bytes(4, 64, kv_quant_dtype("fp8")) == 2 * 4 * (64 + 4)
    assert kv_quant_dtype("auto") is None
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_quant_dtype("fp4")


@pytest.mark.parametrize("rows", [1, 3, 70])
def test_codes_stored_out_in_give_the_same_product(rows):
    """`codes_out_in` (codes [out, in], jaxserve/model/feature_major.py) runs the same integer product; the
    layouts it cannot run are refused."""
    rng = np.random.default_rng(rows)
    qw = quantize_weight(jnp.asarray(rng.standard_normal((48, 40), dtype=np.float32)))
    x = jnp.asarray(rng.standard_normal((rows, 48), dtype=np.float32))
    want = quantized_linear(x, qw, "dynamic_int8", min_rows=2)
    turned = QuantizedWeight(qw.codes.T, qw.scales)
    np.testing.assert_array_equal(quantized_linear(x, turned, "dynamic_int8", min_rows=2, codes_out_in=True), want)
    for strategy, options in [("weight_only", {}), ("dynamic_int8", {"act_block_size": 16})]:
        with pytest.raises(ValueError, match=r"\[out, in\]"):
            quantized_linear(x, turned, strategy, codes_out_in=True, **options)
