"""Paged decode kernels (Triton and Mosaic flavours) against the reference, on CPU in interpret mode.

Each case scatters dense per-slot K/V over shuffled pages of a pool filled with garbage, runs the kernel, and
checks it against `paged_decode_attention_reference` (and the reference against a float64 dense oracle).
Grids stay tiny: interpret mode compiles and runs every grid step on the CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kernels_for_platform, select_attention_backend
from pallas_kernels.decode_gpu import paged_decode_attention_gpu
from pallas_kernels.decode_tpu import paged_decode_attention_tpu
from pallas_kernels.reference import paged_decode_attention_reference
from pallas_kernels.testing import TOLERANCES, dense_attention, random_paged_case

KERNELS = {"triton": paged_decode_attention_gpu, "mosaic": paged_decode_attention_tpu}

# (dtype, page_size, group, head_dim, lengths, max_pages, extra kwargs). Lengths cover 1, exact page
# boundaries, ragged mixes and idle slots (0); the group sizes are the GQA ratios 1, 4 and 8.
CASES = [
    ("float32", 8, 1, 64, [1, 8, 16, 13], 3, {}),
    ("bfloat16", 16, 4, 128, [33, 0, 16, 1], 3, {}),
    ("float32", 16, 8, 64, [47, 48], 3, {}),
    ("bfloat16", 8, 4, 64, [24, 7], 4, {"soft_cap": 1.5}),
    ("float32", 8, 2, 128, [1, 5, 6, 29], 4, {"sliding_window": 5}),
    ("bfloat16", 16, 1, 64, [40, 0, 17], 3, {"sliding_window": 20, "soft_cap": 2.0}),
    ("float32", 4, 4, 64, [9, 3, 12, 0], 4, {"pages_per_compute_block": 4}),
    ("float32", 16, 4, 64, [70, 16], 5, {"pages_per_compute_block": 1}),  # many loop steps, 2-buffer swap
]
IDS = [f"{c[0]}-S{c[1]}-G{c[2]}-D{c[3]}-{'_'.join(map(str, c[4]))}{''.join('-' + k for k in c[6])}"
       for c in CASES]


def _setup(dtype, page_size, group, head_dim, lengths, max_pages, num_kv_heads=2, seed=0):
    rng = np.random.default_rng(seed)
    case = random_paged_case(rng, lengths, num_kv_heads=num_kv_heads, page_size=page_size,
                             head_dim=head_dim, max_pages=max_pages)
    q = jnp.asarray(rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)), dtype)
    k_pages = jnp.asarray(case.k_pages, dtype)
    v_pages = jnp.asarray(case.v_pages, dtype)
    return q, k_pages, v_pages, jnp.asarray(lengths, jnp.int32), jnp.asarray(case.page_tables), case


def _assert_close(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol)


@pytest.mark.parametrize("flavour", sorted(KERNELS))
@pytest.mark.parametrize("dtype,page_size,group,head_dim,lengths,max_pages,extra", CASES, ids=IDS)
def test_decode_matches_reference(flavour, dtype, page_size, group, head_dim, lengths, max_pages, extra):
    q, k_pages, v_pages, lens, tables, _ = _setup(dtype, page_size, group, head_dim, lengths, max_pages)
    sm_scale = head_dim ** -0.5
    options = {k: extra[k] for k in ("soft_cap", "sliding_window") if k in extra}
    got = KERNELS[flavour](q, k_pages, v_pages, lens, tables, sm_scale=sm_scale, interpret=True, **extra)
    want = paged_decode_attention_reference(q, k_pages, v_pages, lens, tables, sm_scale=sm_scale, **options)
    assert got.shape == q.shape and got.dtype == q.dtype
    _assert_close(got, want, dtype)
    for b, length in enumerate(lengths):
        if length == 0:
            assert not np.asarray(got[b], np.float32).any(), "idle slot must give zeros"


@pytest.mark.parametrize("dtype,page_size,group,head_dim,lengths,max_pages,extra", CASES[:6], ids=IDS[:6])
def test_reference_matches_dense_oracle(dtype, page_size, group, head_dim, lengths, max_pages, extra):
    """The reference gathers through the same shuffled table; check it against attention over dense K/V."""
    q, k_pages, v_pages, lens, tables, case = _setup(dtype, page_size, group, head_dim, lengths, max_pages)
    sm_scale = head_dim ** -0.5
    options = {k: extra[k] for k in ("soft_cap", "sliding_window") if k in extra}
    want = paged_decode_attention_reference(q, k_pages, v_pages, lens, tables, sm_scale=sm_scale, **options)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype), np.float32)  # the inputs the kernels really saw
    qn = np.asarray(q, np.float32)
    for b, length in enumerate(lengths):
        oracle = dense_attention(qn[b:b + 1], rounded(case.dense_k[b]), rounded(case.dense_v[b]),
                                 np.array([length - 1]), length, sm_scale=sm_scale, **options)
        _assert_close(want[b:b + 1], oracle, dtype)


def test_tpu_double_buffering_has_no_races():
    q, k_pages, v_pages, lens, tables, _ = _setup("float32", 8, 4, 64, [30, 9], 4)
    params = pltpu.InterpretParams(detect_races=True)
    got = paged_decode_attention_tpu(q, k_pages, v_pages, lens, tables, sm_scale=0.125, interpret=params,
                                     pages_per_compute_block=1)
    want = paged_decode_attention_reference(q, k_pages, v_pages, lens, tables, sm_scale=0.125)
    _assert_close(got, want, "float32")


@pytest.mark.parametrize("flavour", ["triton", "mosaic"])
def test_backend_inside_outer_jit(flavour):
    """The engine calls the backend from its own jitted step with traced lengths and page tables; a tiny
    head_dim (8, like stories260K) must still run in interpret mode."""
    backend = kernels_for_platform("cpu", cpu_flavour=flavour)
    assert backend.name == f"pallas-{flavour} (interpret)"
    q, k_pages, v_pages, lens, tables, _ = _setup("float32", 8, 2, 8, [5, 17, 0], 3, num_kv_heads=4)

    @jax.jit
    def step(q, k_pages, v_pages, lens, tables):
        return backend.decode(q, k_pages, v_pages, lens, tables, sm_scale=0.3, sliding_window=None)

    got = step(q, k_pages, v_pages, lens, tables)
    want = paged_decode_attention_reference(q, k_pages, v_pages, lens, tables, sm_scale=0.3)
    _assert_close(got, want, "float32")


def test_platform_selection(monkeypatch):
    assert kernels_for_platform("gpu").name == "pallas-triton"
    assert kernels_for_platform("cuda").name == "pallas-triton"
    assert kernels_for_platform("tpu").name == "pallas-mosaic"
    monkeypatch.delenv("JAXSERVE_PALLAS_CPU_FLAVOUR", raising=False)
    assert kernels_for_platform("cpu").name == "pallas-triton (interpret)"
    assert select_attention_backend("pallas", platform="cpu").name == "pallas-triton (interpret)"
    assert select_attention_backend("auto", platform="cpu").name == "reference (jnp)"
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "tpu")
    assert kernels_for_platform("cpu").name == "pallas-mosaic (interpret)"
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "cuda-graphs")
    with pytest.raises(ValueError, match="flavour"):
        kernels_for_platform("cpu")
    with pytest.raises(NotImplementedError):
        kernels_for_platform("metal")


def _bad_inputs():
    q = jnp.zeros((2, 4, 64), jnp.float32)
    kv = jnp.zeros((2, 6, 8, 64), jnp.float32)
    lens = jnp.array([3, 4], jnp.int32)
    table = jnp.zeros((2, 3), jnp.int32)
    return [
        ("q must be", (q[0], kv, kv, lens, table), {}),
        ("v_pages shape", (q, kv, kv[:, :5], lens, table), {}),
        ("head_dim", (q, kv[..., :32], kv[..., :32], lens, table), {}),
        ("multiple of num_kv_heads", (q[:, :3], kv, kv, lens, table), {}),
        ("integer", (q, kv, kv, lens, table.astype(jnp.float32)), {}),
        ("page_tables must be", (q, kv, kv, lens, table[:1]), {}),
        ("lengths must be", (q, kv, kv, lens[:1], table), {}),
        ("lengths must be an integer", (q, kv, kv, lens.astype(jnp.float32), table), {}),
        ("soft_cap", (q, kv, kv, lens, table), {"soft_cap": -1.0}),
        ("sliding_window", (q, kv, kv, lens, table), {"sliding_window": 0}),
        ("pages_per_compute_block", (q, kv, kv, lens, table), {"pages_per_compute_block": 0}),
    ]


@pytest.mark.parametrize("flavour", sorted(KERNELS))
@pytest.mark.parametrize("match,args,kwargs", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_validation_errors(flavour, match, args, kwargs):
    with pytest.raises(ValueError, match=match):
        KERNELS[flavour](*args, sm_scale=0.1, interpret=True, **kwargs)


def test_triton_shape_limits_outside_interpret_mode():
    q = jnp.zeros((2, 4, 80), jnp.float32)
    kv = jnp.zeros((2, 6, 8, 80), jnp.float32)
    with pytest.raises(ValueError, match="power-of-2"):
        paged_decode_attention_gpu(q, kv, kv, jnp.array([3, 4]), jnp.zeros((2, 3), jnp.int32), sm_scale=0.1)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_lower_for_real_hardware(platform):
    """Lower (not run) the non-interpret kernels for an abstract H200 / TPU v5e: this catches Triton's
    power-of-2 and Mosaic's block-shape rules on CPU. Triton->PTX and Mosaic's layout passes still need the
    hardware (benchmarks/gpu_kernels.py)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
    kind, dev_platform = ("NVIDIA H200", "gpu") if platform == "cuda" else ("TPU v5 lite", "tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind=kind, num_cores=1, platform=dev_platform))
    kernel = KERNELS["triton" if platform == "cuda" else "mosaic"]
    shape = jax.ShapeDtypeStruct
    args = (shape((4, 32, 128), jnp.bfloat16), shape((8, 65, 16, 128), jnp.bfloat16),
            shape((8, 65, 16, 128), jnp.bfloat16), shape((4,), jnp.int32), shape((4, 16), jnp.int32))
    fn = jax.jit(lambda *a: kernel(*a, sm_scale=0.088, soft_cap=30.0, sliding_window=100))
    with use_abstract_mesh(mesh):
        text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert ("__gpu$xla.gpu.triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)
