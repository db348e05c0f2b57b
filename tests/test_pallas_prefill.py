"""Paged prefill kernels (Triton and Mosaic flavours) against the reference, on CPU in interpret mode.

A case is one sequence: `kv_len` cached tokens (the earlier prefix plus this chunk's own K/V) scattered over
shuffled pages, and a chunk of `chunk` query rows starting at `q_start`; rows past kv_len are padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kernels_for_platform
from pallas_kernels.prefill_gpu import paged_prefill_attention_gpu
from pallas_kernels.prefill_tpu import paged_prefill_attention_tpu
from pallas_kernels.reference import paged_prefill_attention_reference
from pallas_kernels.testing import TOLERANCES, dense_attention, random_paged_case

KERNELS = {"triton": paged_prefill_attention_gpu, "mosaic": paged_prefill_attention_tpu}

# (dtype, page_size, group, head_dim, q_start, chunk, kv_len, max_pages, extra kwargs)
CASES = [
    ("float32", 8, 1, 64, 0, 16, 16, 3, {}),  # first chunk, ends on a page boundary
    ("bfloat16", 16, 4, 128, 19, 8, 24, 3, {}),  # prefix + chunk with 3 padding rows
    ("float32", 8, 8, 64, 16, 1, 17, 4, {}),  # one-token chunk right after a page boundary
    ("bfloat16", 8, 2, 64, 10, 12, 22, 4, {"sliding_window": 6}),
    ("float32", 16, 4, 64, 5, 20, 25, 3, {"soft_cap": 1.5}),
    ("float32", 8, 1, 128, 0, 8, 0, 2, {}),  # all-padding chunk -> zeros
    ("bfloat16", 8, 3, 64, 3, 13, 16, 3, {}),  # non-power-of-2 group
    ("float32", 4, 4, 64, 7, 9, 16, 5, {"sliding_window": 3, "soft_cap": 2.0}),
    ("float32", 8, 2, 64, 8, 40, 48, 7, {"block_q": 16, "pages_per_compute_block": 2}),  # many q/k blocks
]
IDS = [f"{c[0]}-S{c[1]}-G{c[2]}-D{c[3]}-q{c[4]}+{c[5]}-kv{c[6]}{''.join('-' + k for k in c[8])}" for c in CASES]


def _setup(dtype, page_size, group, head_dim, q_start, chunk, kv_len, max_pages, num_kv_heads=2, seed=1):
    rng = np.random.default_rng(seed)
    case = random_paged_case(rng, [kv_len], num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim,
                             max_pages=max_pages)
    q = jnp.asarray(rng.standard_normal((chunk, num_kv_heads * group, head_dim)), dtype)
    return (q, jnp.asarray(case.k_pages, dtype), jnp.asarray(case.v_pages, dtype), jnp.int32(q_start),
            jnp.int32(kv_len), jnp.asarray(case.page_tables[0]), case)


def _assert_close(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol)


@pytest.mark.parametrize("flavour", sorted(KERNELS))
@pytest.mark.parametrize("dtype,page_size,group,head_dim,q_start,chunk,kv_len,max_pages,extra", CASES, ids=IDS)
def test_prefill_matches_reference(flavour, dtype, page_size, group, head_dim, q_start, chunk, kv_len,
                                   max_pages, extra):
    q, k_pages, v_pages, qs, kl, table, _ = _setup(dtype, page_size, group, head_dim, q_start, chunk, kv_len,
                                                    max_pages)
    sm_scale = head_dim ** -0.5
    options = {k: extra[k] for k in ("soft_cap", "sliding_window") if k in extra}
    got = KERNELS[flavour](q, k_pages, v_pages, qs, kl, table, sm_scale=sm_scale, interpret=True, **extra)
    want = paged_prefill_attention_reference(q, k_pages, v_pages, qs, kl, table, sm_scale=sm_scale, **options)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, want, dtype)
    padding = max(0, q_start + chunk - kv_len)
    if padding:
        assert not np.asarray(got[chunk - padding:], np.float32).any(), "padding rows must be zeros"


@pytest.mark.parametrize("dtype,page_size,group,head_dim,q_start,chunk,kv_len,max_pages,extra", CASES[:8],
                         ids=IDS[:8])
def test_reference_matches_dense_oracle(dtype, page_size, group, head_dim, q_start, chunk, kv_len, max_pages,
                                        extra):
    q, k_pages, v_pages, qs, kl, table, case = _setup(dtype, page_size, group, head_dim, q_start, chunk, kv_len,
                                                       max_pages)
    sm_scale = head_dim ** -0.5
    options = {k: extra[k] for k in ("soft_cap", "sliding_window") if k in extra}
    want = paged_prefill_attention_reference(q, k_pages, v_pages, qs, kl, table, sm_scale=sm_scale, **options)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype), np.float32)
    oracle = dense_attention(np.asarray(q, np.float32), rounded(case.dense_k[0]), rounded(case.dense_v[0]),
                             q_start + np.arange(chunk), kv_len, sm_scale=sm_scale, **options)
    _assert_close(want, oracle, dtype)


def test_tpu_double_buffering_has_no_races():
    q, k_pages, v_pages, qs, kl, table, _ = _setup("float32", 8, 2, 64, 8, 24, 32, 4)
    params = pltpu.InterpretParams(detect_races=True)
    got = paged_prefill_attention_tpu(q, k_pages, v_pages, qs, kl, table, sm_scale=0.125, interpret=params,
                                      block_q=16, pages_per_compute_block=1)
    want = paged_prefill_attention_reference(q, k_pages, v_pages, qs, kl, table, sm_scale=0.125)
    _assert_close(got, want, "float32")


@pytest.mark.parametrize("flavour", ["triton", "mosaic"])
def test_backend_inside_outer_jit(flavour):
    """Traced q_start / kv_len, as the engine's jitted prefill step passes them; one compile serves both
    chunks of the sequence. head_dim 8 (stories260K) runs in interpret mode."""
    backend = kernels_for_platform("cpu", cpu_flavour=flavour)
    q, k_pages, v_pages, _, _, table, _ = _setup("float32", 8, 2, 8, 0, 16, 27, 4)

    @jax.jit
    def step(q, k_pages, v_pages, q_start, kv_len, table):
        return backend.prefill(q, k_pages, v_pages, q_start, kv_len, table, sm_scale=0.3, sliding_window=None)

    for q_start, kv_len in ((0, 16), (16, 27)):
        got = step(q, k_pages, v_pages, jnp.int32(q_start), jnp.int32(kv_len), table)
        want = paged_prefill_attention_reference(q, k_pages, v_pages, q_start, kv_len, table, sm_scale=0.3)
        _assert_close(got, want, "float32")
    assert step._cache_size() == 1


def _bad_inputs():
    q = jnp.zeros((8, 4, 64), jnp.float32)
    kv = jnp.zeros((2, 6, 8, 64), jnp.float32)
    table = jnp.zeros((3,), jnp.int32)
    qs, kl = jnp.int32(0), jnp.int32(8)
    return [
        ("q must be", (q[0], kv, kv, qs, kl, table), {}),
        ("v_pages shape", (q, kv, kv[:, :5], qs, kl, table), {}),
        ("head_dim", (q, kv[..., :32], kv[..., :32], qs, kl, table), {}),
        ("multiple of num_kv_heads", (q[:, :3], kv, kv, qs, kl, table), {}),
        ("integer array", (q, kv, kv, qs, kl, table.astype(jnp.float32)), {}),
        ("page_table must be", (q, kv, kv, qs, kl, table[None]), {}),
        ("q_start must be", (q, kv, kv, jnp.zeros((2,), jnp.int32), kl, table), {}),
        ("kv_len must be", (q, kv, kv, qs, jnp.float32(8), table), {}),
        ("soft_cap", (q, kv, kv, qs, kl, table), {"soft_cap": 0.0}),
        ("sliding_window", (q, kv, kv, qs, kl, table), {"sliding_window": -2}),
        ("block_q", (q, kv, kv, qs, kl, table), {"block_q": 24}),
    ]


@pytest.mark.parametrize("flavour", sorted(KERNELS))
@pytest.mark.parametrize("match,args,kwargs", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_validation_errors(flavour, match, args, kwargs):
    with pytest.raises(ValueError, match=match):
        KERNELS[flavour](*args, sm_scale=0.1, interpret=True, **kwargs)


def test_triton_shape_limits_outside_interpret_mode():
    q = jnp.zeros((8, 4, 64), jnp.float32)
    kv = jnp.zeros((2, 6, 12, 64), jnp.float32)  # page_size 12
    with pytest.raises(ValueError, match="power-of-2"):
        paged_prefill_attention_gpu(q, kv, kv, 0, 8, jnp.zeros((3,), jnp.int32), sm_scale=0.1)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_real_hardware(platform):
    """Lower (not run) the non-interpret kernels for an abstract H200 / TPU v5e (see the decode twin)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    kind, dev_platform = ("NVIDIA H200", "gpu") if platform == "cuda" else ("TPU v5 lite", "tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform=dev_platform))
    kernel = KERNELS["triton" if platform == "cuda" else "mosaic"]
    shape = jax.ShapeDtypeStruct
    args = (shape((256, 32, 128), jnp.bfloat16), shape((8, 65, 16, 128), jnp.bfloat16),
            shape((8, 65, 16, 128), jnp.bfloat16), shape((), jnp.int32), shape((), jnp.int32),
            shape((40,), jnp.int32))
    fn = jax.jit(lambda *a: kernel(*a, sm_scale=0.088, soft_cap=30.0, sliding_window=100))
    with use_abstract_mesh(mesh):
        text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("__gpu$xla.gpu.triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)
