"""Ragged paged attention: the Pallas kernels (Triton and Mosaic flavours, CPU interpret mode) and the blocked
jnp implementation against `ragged_paged_attention_reference`, and the reference against a float64 oracle.

Each case is one ragged step: a list of (q_len, kv_len) sequences whose dense K/V is scattered over shuffled
pages of a pool filled with garbage, flat query rows, and padding rows after the last sequence. Grids stay
tiny: interpret mode runs every grid step on the CPU.

Quantized KV pages (int8 / fp8 codes with per-token scales) run every case of the sweep too: each
implementation against the quantized reference (tight, as for float pages), one page dtype per
(implementation, case) alternating so every implementation and every case meets both dtypes without
doubling the interpret-mode runs; and the reference on quantized pages against float32 pages, within
`KV_QUANT_TOLERANCES` (the quantization error itself, see docs/quantization.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kernels_for_platform, select_attention_backend
from pallas_kernels.blocked import MULTIPLY_SUM_MIN_SEQS, ragged_paged_attention_blocked
from pallas_kernels.dispatch import BLOCKED_MULTIPLY_SUM
from pallas_kernels.kv_quant import scales_shape
from pallas_kernels import ragged_gpu
from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu
from pallas_kernels.testing import (
    KV_QUANT_TOLERANCES,
    TOLERANCES,
    interpreted,
    jitted_reference,
    quantize_pages,
    ragged_oracle,
    random_ragged_case,
)


reference = jitted_reference  # the answer every implementation is checked against


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (q_len, kv_len) per sequence
    dtype: str = "float32"
    group: int = 2
    head_dim: int = 64
    page_size: int = 8
    max_pages: int = 4
    padding_tokens: int = 0
    soft_cap: float | None = None
    sliding_window: int | None = None
    blocks: bool = False  # explicit small block sizes, so every loop runs many steps

    @property
    def id(self) -> str:
        dtype = "f32" if self.dtype == "float32" else "bf16"
        return f"{self.name}-{dtype}-G{self.group}-D{self.head_dim}-P{self.page_size}"


# Lengths cover 1, exact page boundaries (kv_len a multiple of the page size), prefill chunks over a cached
# prefix (kv_len > q_len), padding sequences (0, 0), an unscheduled sequence (0, n) and padding token rows.
CASES = [
    Case("decode-only", ((1, 1), (1, 8), (1, 16), (1, 13)), group=1, padding_tokens=2),
    Case("prefill-only", ((16, 16), (7, 7)), dtype="bfloat16", page_size=16, head_dim=128, max_pages=2),
    Case("mixed-prefix", ((1, 17), (9, 24), (0, 0), (1, 4), (0, 11), (5, 5)), group=4, page_size=4,
         max_pages=6, padding_tokens=3),
    Case("gqa8", ((3, 40), (1, 33), (12, 12)), dtype="bfloat16", group=8, max_pages=5),
    Case("group3", ((13, 16), (1, 9), (0, 0)), dtype="bfloat16", group=3, padding_tokens=1),
    Case("window", ((1, 29), (6, 22), (1, 5)), group=2, head_dim=128, sliding_window=5),
    Case("softcap", ((8, 24), (1, 7)), dtype="bfloat16", group=4, soft_cap=1.5),
    Case("window+cap", ((9, 16), (1, 40), (3, 3)), dtype="bfloat16", group=1, page_size=16, max_pages=3,
         sliding_window=20, soft_cap=2.0),
    Case("many-blocks", ((20, 32), (1, 70), (1, 1), (11, 11)), group=2, page_size=4, max_pages=18,
         padding_tokens=5, blocks=True),
    # The first key the window lets each tile see sits at every offset of a 4-key block, and at the last
    # of a 16-key one (the smallest Triton key block).
    Case("many-blocks-window", ((1, 37), (13, 30), (1, 11), (1, 24)), group=2, page_size=4, max_pages=10,
         sliding_window=9, soft_cap=3.0, blocks=True),
    # With 4-key blocks and 4-row query windows (the blocked jnp path), the window's first key falls on
    # the last key of a block for the chunk's windows (11, 15, ...) and for the decode row (18 - 7 = 11).
    Case("window-block-edge", ((13, 30), (1, 18)), group=2, page_size=4, max_pages=10, sliding_window=7,
         blocks=True),
    Case("all-padding", ((0, 0), (0, 0)), page_size=16, max_pages=1, padding_tokens=4),
]

# Explicit small blocks per implementation for `blocks=True` cases: one page per key block, and the
# smallest query tile each allows (Triton: 16 rows; Mosaic: 16 tokens).
SMALL_BLOCKS = {
    "pallas-triton": dict(block_q=8, pages_per_compute_block=1),
    "pallas-mosaic": dict(block_q=16, pages_per_compute_block=1),
    "blocked": dict(pages_per_block=1, query_window=4),
    "blocked-multiply-sum": dict(pages_per_block=1, query_window=4),
}
IMPLEMENTATIONS = {
    "pallas-triton": interpreted(ragged_paged_attention_gpu),
    "pallas-mosaic": interpreted(ragged_paged_attention_tpu),
    "blocked": ragged_paged_attention_blocked,
    "blocked-multiply-sum": BLOCKED_MULTIPLY_SUM.ragged,  # what step programs with Eigen dots use
}
TRITON = IMPLEMENTATIONS["pallas-triton"]  # one jitted wrapper: calls of the same options and shapes share a compile


def _setup(case: Case, num_kv_heads: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = zip(*case.seqs)
    ragged = random_ragged_case(rng, list(q_lens), list(kv_lens), num_kv_heads=num_kv_heads, group=case.group,
                                page_size=case.page_size, head_dim=case.head_dim, max_pages=case.max_pages,
                                padding_tokens=case.padding_tokens)
    args = (jnp.asarray(ragged.q, case.dtype), jnp.asarray(ragged.paged.k_pages, case.dtype),
            jnp.asarray(ragged.paged.v_pages, case.dtype), jnp.asarray(ragged.kv_lens),
            jnp.asarray(ragged.paged.page_tables), jnp.asarray(ragged.cu_q_lens))
    return args, ragged


def _options(case: Case) -> dict:
    return dict(sm_scale=case.head_dim ** -0.5, soft_cap=case.soft_cap, sliding_window=case.sliding_window)


def _assert_close(got, want, dtype):
    atol, rtol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol)


def _assert_padding_zero(got, cu_q_lens):
    assert not np.asarray(got[int(cu_q_lens[-1]):], np.float32).any(), "padding rows must be exact zeros"


# The interpreted kernels (seconds of compile a case) skip three float-page cases whose paths their other
# cases take: `window` and `softcap` (a window and a cap each meet them together in window+cap, and under
# small blocks in many-blocks-window; head_dim 128 in prefill-only) and `window-block-edge` (the blocked jnp
# path's block edge; the kernels' window edges are many-blocks-window's). `blocked` runs every case;
# `blocked-multiply-sum` the cases of MULTIPLY_SUM_MIN_SEQS sequences up: with fewer it keeps the dots and
# compiles `blocked`'s very program (the quantized sweep below still gives it every case).
_KERNEL_SKIPS_THEIR_PATHS = {"window", "softcap", "window-block-edge"}


def _float_pages_run(impl: str, case: Case) -> bool:
    if impl.startswith("pallas"):
        return case.name not in _KERNEL_SKIPS_THEIR_PATHS
    return impl == "blocked" or len(case.seqs) >= MULTIPLY_SUM_MIN_SEQS


FLOAT_GRID = [(impl, case) for impl in sorted(IMPLEMENTATIONS) for case in CASES if _float_pages_run(impl, case)]


@pytest.mark.parametrize("impl,case", FLOAT_GRID, ids=[f"{c.id}-{i}" for i, c in FLOAT_GRID])
def test_matches_reference(impl, case):
    args, ragged = _setup(case)
    extra = SMALL_BLOCKS[impl] if case.blocks else {}
    got = IMPLEMENTATIONS[impl](*args, **_options(case), **extra)
    want = reference(*args, **_options(case))
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    _assert_close(got, want, case.dtype)
    _assert_padding_zero(got, ragged.cu_q_lens)


KV_DTYPES = ("int8", "fp8")
# The interpreted kernels (seconds a case) see half the cases over quantized pages: decodes, a prefix, wide
# GQA, window with cap, small blocks under a window, all padding. Their float-page runs above see every case,
# and the jnp paths see every case here too.
_QUANT_KERNEL_CASES = {"decode-only", "mixed-prefix", "gqa8", "window+cap", "many-blocks-window", "all-padding"}
QUANT_GRID = [(impl, case, KV_DTYPES[(i + j) % 2]) for j, impl in enumerate(sorted(IMPLEMENTATIONS))
              for i, case in enumerate(CASES) if not impl.startswith("pallas") or case.name in _QUANT_KERNEL_CASES]
_quantized_references: dict = {}


def _setup_quantized(case: Case, kv_dtype: str):
    """The case with its pages quantized (every page, garbage too) and the quantized reference's answer,
    computed once per (case, dtype) and shared by the tests that need it."""
    args, ragged = _setup(case)
    (k, v), scales = quantize_pages(jnp.asarray(ragged.paged.k_pages), jnp.asarray(ragged.paged.v_pages), kv_dtype)
    args = (args[0], k, v) + args[3:]
    key = (case, kv_dtype)
    if key not in _quantized_references:
        _quantized_references[key] = reference(*args, **_options(case), **scales)
    return args, scales, ragged, _quantized_references[key]


@pytest.mark.parametrize("impl,case,kv_dtype", QUANT_GRID, ids=[f"{i}-{c.id}-{d}" for i, c, d in QUANT_GRID])
def test_quantized_pages_match_quantized_reference(impl, case, kv_dtype):
    args, scales, ragged, want = _setup_quantized(case, kv_dtype)
    extra = SMALL_BLOCKS[impl] if case.blocks else {}
    got = IMPLEMENTATIONS[impl](*args, **_options(case), **scales, **extra)
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    _assert_close(got, want, case.dtype)
    _assert_padding_zero(got, ragged.cu_q_lens)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_quantized_pages_stay_close_to_float32_pages(case, kv_dtype):
    """The quantization error itself: float32 queries over int8 / fp8 pages vs over the float32 pages."""
    _, ragged = _setup(case)
    k, v = jnp.asarray(ragged.paged.k_pages), jnp.asarray(ragged.paged.v_pages)
    rest = (jnp.asarray(ragged.kv_lens), jnp.asarray(ragged.paged.page_tables), jnp.asarray(ragged.cu_q_lens))
    q = jnp.asarray(ragged.q)
    want = np.asarray(reference(q, k, v, *rest, **_options(case)))
    codes, scales = quantize_pages(k, v, kv_dtype)
    got = np.asarray(reference(q, *codes, *rest, **_options(case), **scales))
    real = int(ragged.cu_q_lens[-1])
    diff = (got - want)[:real]
    max_tol, rms_tol = KV_QUANT_TOLERANCES[kv_dtype]
    if real:
        assert np.abs(diff).max() <= max_tol and np.sqrt(np.mean(diff ** 2)) <= rms_tol, (
            f"{kv_dtype}: max {np.abs(diff).max():.4f} (<= {max_tol}), RMS {np.sqrt(np.mean(diff ** 2)):.4f} "
            f"(<= {rms_tol})")
        assert np.sqrt(np.mean(diff ** 2)) > 0, "quantized pages gave exactly the float answer: not quantized?"
    _assert_padding_zero(got, ragged.cu_q_lens)


def test_triton_result_does_not_depend_on_program_order(monkeypatch):
    """Interpret mode runs the programs in grid order, so a tile spilling into the next sequence's rows
    would be overwritten by the right values later; run the items last-first to catch an unmasked store."""
    case = CASES[2]  # mixed-prefix: sequences of 1, 9, 1 and 5 rows in tiles of 8 tokens
    args, ragged = _setup(case)
    in_order = ragged_gpu.work_items
    monkeypatch.setattr(ragged_gpu, "work_items", lambda *a: tuple(x[::-1] for x in in_order(*a)))
    # The jitted wrapper may hold a trace made with the in-order items: call the function it wraps.
    got = ragged_paged_attention_gpu.__wrapped__(*args, **_options(case), interpret=True)
    _assert_close(got, reference(*args, **_options(case)), case.dtype)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_matches_float64_oracle(case):
    """The reference gathers through the same shuffled tables; check it against attention over dense K/V."""
    args, ragged = _setup(case)
    want = reference(*args, **_options(case))
    rounded = lambda x: np.asarray(jnp.asarray(x, case.dtype), np.float32)  # the inputs the kernels really saw
    oracle = ragged_oracle(ragged, rounded(ragged.q), rounded(ragged.paged.dense_k), rounded(ragged.paged.dense_v),
                           **_options(case))
    _assert_close(want, oracle, case.dtype)
    _assert_padding_zero(want, ragged.cu_q_lens)


def test_tpu_double_buffering_has_no_races():
    """Sequences that straddle query blocks, several per block, one page per DMA'd block: the race detector
    raises on any read of a buffer half whose copy has not been waited for."""
    case = Case("races", ((20, 28), (1, 9), (14, 30), (0, 0), (1, 1)), page_size=4, max_pages=8, padding_tokens=2)
    args, ragged = _setup(case)
    params = pltpu.InterpretParams(detect_races=True)
    got = ragged_paged_attention_tpu(*args, **_options(case), interpret=params, block_q=16,
                                     pages_per_compute_block=1)
    _assert_close(got, reference(*args, **_options(case)), "float32")
    _assert_padding_zero(got, ragged.cu_q_lens)


@pytest.mark.parametrize("flavour", ["triton", "mosaic"])
def test_backend_inside_outer_jit(flavour):
    """The engine calls the backend from its own jitted step with traced lengths, tables and row offsets; one
    compile serves any ragged layout of the same bucket. head_dim 8 and 8 query / 4 KV heads, like
    stories260K, must run in interpret mode."""
    backend = kernels_for_platform("cpu", cpu_flavour=flavour)
    assert backend.name == f"pallas-{flavour} (interpret)"

    @jax.jit
    def step(*args):
        return backend.ragged(*args, sm_scale=8 ** -0.5, soft_cap=None, sliding_window=None)

    layouts = [((1, 9), (1, 17), (14, 14), (0, 0)), ((6, 30), (0, 0), (1, 1), (1, 12))]  # both 16 + 2 rows
    for seqs in layouts:
        case = Case("stories", seqs, group=2, head_dim=8, max_pages=4, padding_tokens=18 - sum(q for q, _ in seqs))
        args, ragged = _setup(case, num_kv_heads=4)
        got = step(*args)
        _assert_close(got, reference(*args, sm_scale=8 ** -0.5), "float32")
        _assert_padding_zero(got, ragged.cu_q_lens)
    assert step._cache_size() == 1


def test_platform_selection(monkeypatch):
    assert kernels_for_platform("gpu").name == "pallas-triton"
    assert kernels_for_platform("cuda").name == "pallas-triton"
    assert kernels_for_platform("tpu").name == "pallas-mosaic"
    monkeypatch.delenv("JAXSERVE_PALLAS_CPU_FLAVOUR", raising=False)
    assert kernels_for_platform("cpu").name == "pallas-triton (interpret)"
    assert select_attention_backend("pallas", platform="cpu").name == "pallas-triton (interpret)"
    assert select_attention_backend("auto", platform="cpu").name == "blocked (jnp)"
    assert select_attention_backend("reference", platform="cpu").name == "reference (jnp, dense)"
    assert select_attention_backend("auto", platform="gpu").name == "pallas-triton"
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "tpu")
    assert kernels_for_platform("cpu").name == "pallas-mosaic (interpret)"
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "cuda-graphs")
    with pytest.raises(ValueError, match="flavour"):
        kernels_for_platform("cpu")
    with pytest.raises(NotImplementedError):
        kernels_for_platform("metal")
    with pytest.raises(ValueError, match="attention_backend"):
        select_attention_backend("fastest", platform="cpu")


def _bad_inputs():
    q = jnp.zeros((6, 4, 64), jnp.float32)
    kv = jnp.zeros((2, 6, 8, 64), jnp.float32)
    lens = jnp.array([3, 4], jnp.int32)
    table = jnp.zeros((2, 3), jnp.int32)
    cu = jnp.array([0, 2, 6], jnp.int32)
    kv8 = kv.astype(jnp.int8)
    scales = jnp.ones(scales_shape(*kv.shape[:3]), jnp.float32)
    kv8_odd_pages = jnp.zeros((2, 6, 12, 64), jnp.int8)
    return [
        ("q must be", (q[0], kv, kv, lens, table, cu), {}),
        ("v_pages shape", (q, kv, kv[:, :5], lens, table, cu), {}),
        ("k_pages must be", (q, kv[0], kv[0], lens, table, cu), {}),
        ("head_dim", (q, kv[..., :32], kv[..., :32], lens, table, cu), {}),
        ("multiple of num_kv_heads", (q[:, :3], kv, kv, lens, table, cu), {}),
        ("page tables must be an integer", (q, kv, kv, lens, table.astype(jnp.float32), cu), {}),
        ("page_tables must be", (q, kv, kv, lens, table[0], cu), {}),
        ("kv_lens must be \\[num_seqs", (q, kv, kv, lens[:1], table, cu), {}),
        ("kv_lens must be an integer", (q, kv, kv, lens.astype(jnp.float32), table, cu), {}),
        ("cu_q_lens must be \\[num_seqs", (q, kv, kv, lens, table, cu[1:]), {}),
        ("cu_q_lens must be an integer", (q, kv, kv, lens, table, cu.astype(jnp.float32)), {}),
        ("soft_cap", (q, kv, kv, lens, table, cu), {"soft_cap": -1.0}),
        ("sliding_window", (q, kv, kv, lens, table, cu), {"sliding_window": 0}),
        ("need k_scales and v_scales", (q, kv8, kv8, lens, table, cu), {}),
        ("come together", (q, kv8, kv8, lens, table, cu), {"k_scales": scales}),
        ("with scales must be int8", (q, kv, kv, lens, table, cu), {"k_scales": scales, "v_scales": scales}),
        ("k_scales must be \\[num_kv_heads", (q, kv8, kv8, lens, table, cu),
         {"k_scales": scales[..., :4], "v_scales": scales}),
        ("v_scales must be a float", (q, kv8, kv8, lens, table, cu),
         {"k_scales": scales, "v_scales": scales.astype(jnp.int32)}),
        ("page_size that divides 128", (q, kv8_odd_pages, kv8_odd_pages, lens, table, cu),
         {"k_scales": scales, "v_scales": scales}),
    ]


KERNEL_KNOBS = [("pages_per_compute_block", {"pages_per_compute_block": 0}), ("block_q", {"block_q": 24})]


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("match,args,kwargs", _bad_inputs(), ids=[b[0].replace("\\", "") for b in _bad_inputs()])
def test_validation_errors(impl, match, args, kwargs):
    with pytest.raises(ValueError, match=match):
        IMPLEMENTATIONS[impl](*args, sm_scale=0.1, **kwargs)


@pytest.mark.parametrize("impl", ["pallas-triton", "pallas-mosaic"])
@pytest.mark.parametrize("match,kwargs", KERNEL_KNOBS, ids=[k[0] for k in KERNEL_KNOBS])
def test_kernel_block_size_errors(impl, match, kwargs):
    kv = jnp.zeros((2, 6, 8, 64), jnp.float32)
    args = (jnp.zeros((6, 4, 64), jnp.float32), kv, kv, jnp.array([3, 4]), jnp.zeros((2, 3), jnp.int32),
            jnp.array([0, 2, 6]))
    with pytest.raises(ValueError, match=match):
        IMPLEMENTATIONS[impl](*args, sm_scale=0.1, **kwargs)


TRITON_LIMITS = [("head_dim-80", 80, 8, {}), ("head_dim-8", 8, 8, {}), ("page_size-12", 64, 12, {}),
                 ("pages_per_block-3", 64, 8, {"pages_per_compute_block": 3})]


@pytest.mark.parametrize("what,head_dim,page_size,kwargs", TRITON_LIMITS, ids=[t[0] for t in TRITON_LIMITS])
def test_triton_shape_limits_outside_interpret_mode(what, head_dim, page_size, kwargs):
    q = jnp.zeros((6, 4, head_dim), jnp.float32)
    kv = jnp.zeros((2, 6, page_size, head_dim), jnp.float32)
    args = (q, kv, kv, jnp.array([3, 4]), jnp.zeros((2, 3), jnp.int32), jnp.array([0, 2, 6]))
    with pytest.raises(ValueError, match="power-of-2|power of 2"):
        ragged_paged_attention_gpu(*args, sm_scale=0.1, **kwargs)


# Each case split one way (a compile each): 3 splits give uneven shares of many-blocks' 2-18 blocks and
# splits with no block at decode-only's short contexts; 2 splits cover the window and the chunks over a prefix.
SPLITS = {"decode-only": 3, "mixed-prefix": 2, "many-blocks": 3, "many-blocks-window": 2}
SPLIT_CASES = [c for c in CASES if c.name in SPLITS]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[f"{c.id}-splits{SPLITS[c.name]}" for c in SPLIT_CASES])
def test_triton_split_kv_matches_reference(case):
    """num_kv_splits > 1 (split-K): each item's key blocks are shared among programs and merged after the
    kernel. Uneven shares (3 splits of 2-18 blocks), splits that get no block, sliding windows and padding
    rows must all give the unsplit answer."""
    args, _ = _setup(case)
    opts = dict(_options(case), **(SMALL_BLOCKS["pallas-triton"] if case.blocks else {}))
    got = TRITON(*args, **opts, num_kv_splits=SPLITS[case.name], min_keys_per_split=1)
    _assert_close(got, reference(*args, **_options(case)), case.dtype)
    _assert_padding_zero(got, args[5])


def test_triton_split_kv_uses_only_splits_of_enough_keys():
    """num_kv_splits is an upper bound: a sequence uses only the splits that get at least min_keys_per_split
    keys, so in one batch short contexts stay whole while long ones split. At three thresholds (sequences of
    8 and 18 key blocks split 3 and 4 ways, then 1 and 3 ways, then none) the answer must be the reference's:
    a share rule that drops or repeats a block, or a split left without an empty state, breaks it."""
    case = next(c for c in CASES if c.name == "many-blocks")
    args, _ = _setup(case)
    opts = dict(_options(case), **SMALL_BLOCKS["pallas-triton"])
    kernel = TRITON
    block_keys = SMALL_BLOCKS["pallas-triton"]["pages_per_compute_block"] * args[1].shape[2]
    want = reference(*args, **_options(case))
    for min_keys in (3 * block_keys, 8 * block_keys, 10 ** 6):
        got = kernel(*args, **opts, num_kv_splits=4, min_keys_per_split=min_keys)
        _assert_close(got, want, case.dtype)
        _assert_padding_zero(got, args[5])


def test_triton_split_kv_over_quantized_pages():
    case = next(c for c in CASES if c.name == "many-blocks-window")
    args, _ = _setup(case)
    q, k_pages, v_pages, *rest = args
    (k, v), scales = quantize_pages(k_pages, v_pages, "int8")
    opts = dict(_options(case), **SMALL_BLOCKS["pallas-triton"], **scales)
    kernel = TRITON  # its unsplit call is the quantized sweep's (int8, many-blocks-window): compiled once
    _assert_close(kernel(q, k, v, *rest, **opts, num_kv_splits=3, min_keys_per_split=1),
                  kernel(q, k, v, *rest, **opts), case.dtype)


def test_triton_default_tiles_follow_the_batch_shape():
    """Decode-shaped batches (no more tokens than sequences) get tl.dot's minimum of 16 query rows, batches
    holding prefill chunks 64 rows for 2-byte queries and 32 for float32 (the choice measured on an H200:
    pallas_kernels/ragged_gpu.py); 64-key blocks, the faster on the H200 for both bf16 shapes."""
    tiles = ragged_gpu.default_tiles
    assert tiles(64, 64, group_pad=4, itemsize=2) == (4, 64)  # 4 tokens x 4 heads = 16 rows
    assert tiles(2048, 64, group_pad=4, itemsize=2) == (16, 64)  # 64 rows
    assert tiles(2048, 64, group_pad=4, itemsize=4) == (8, 64)  # 32 rows
    assert tiles(1, 1, group_pad=1, itemsize=2) == (16, 64)
    assert tiles(96, 6, group_pad=8, itemsize=2) == (8, 64)


def test_triton_default_kv_splits_follow_the_bucket():
    """Split-K by default only in decode-shaped batches, up to 16 splits, fewer as the bucket grows (tokens
    x splits <= 256, which bounds the float32 partial outputs) and as the longest context shrinks;
    prefill-shaped batches and interpret mode keep one."""
    splits = ragged_gpu.default_kv_splits
    assert [splits(t, 256, interpret=False) for t in (1, 16, 32, 64, 128, 256)] == [16, 16, 8, 4, 2, 1]
    assert splits(2048, 64, interpret=False) == 1  # holds prefill chunks
    assert splits(16, 16, interpret=True) == 1
    # No more splits than the page tables' longest context gives at min_keys_per_split keys each.
    assert [splits(16, 16, interpret=False, max_keys=k) for k in (512, 1024, 2048, 8192, 32768)] == [1, 1, 2, 8, 16]
    assert splits(16, 16, interpret=False, max_keys=2048, min_keys_per_split=256) == 8
