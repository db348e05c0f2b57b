"""Random paged caches for kernel tests and benchmarks (host-side numpy; no Pallas needed).

1. Draw dense per-sequence K/V (`[n, num_kv_heads, tokens, head_dim]`) and fill a page pool with garbage.
2. Give each sequence distinct pages picked at random from the pool (never the null page 0) and write its
   dense tokens into them; the rest of its page-table row points at the null page.
3. Keep the dense K/V, so a test can check the paged answer against attention over the dense arrays
   (`dense_attention`), independently of how the reference gathers pages.
4. `image_spans` marks runs of a batch's rows as bidirectional spans (`span_ends`), as Gemma 3's images.
5. `quantize_pages` turns float pages into int8 / fp8 codes with per-token scales (`kv_quant`).
6. `interpreted` runs a Pallas kernel in interpret mode, compiled cheaply (see `INTERPRET_COMPILER_OPTIONS`);
   `jitted_reference` is the answer it is checked against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from pallas_kernels.kv_quant import KV_CACHE_DTYPES, lane_dense_scales, quantize_kv_tokens
from pallas_kernels.reference import ragged_paged_attention_reference

# Kernel vs reference, keyed by dtype name: (atol, rtol). bf16 kernels round p to bf16 before p @ V.
TOLERANCES = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}

# Attention over quantized pages vs over the float32 pages they came from, unit-variance K/V and queries
# (docs/quantization.md): (max |diff|, RMS of diff) over real rows. About twice the largest error measured
# over every case of the kernel sweeps (int8 0.025 / 0.005, fp8 0.12 / 0.018). An element's rounding error
# is at most absmax / 254 for int8 (~0.014 at absmax 3.5) and |x| / 16 for e4m3 (3 mantissa bits), and an
# output row is a convex combination of value rows, so a row that sees one key inherits its full error.
KV_QUANT_TOLERANCES = {"int8": (0.05, 0.01), "fp8": (0.25, 0.04)}


# Interpret mode checks a kernel's logic on the CPU; the CPU code it compiles to is never what a user runs
# (they run the kernel on a GPU or TPU), so it is compiled without LLVM's optimizations: a Mosaic kernel
# compiles 3x faster here, a Triton one 1.7x, and runs as long either way (tiny grids).
INTERPRET_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


# The reference, jitted: called outside jit, its vmapped gather compiles operation by operation (seconds per
# case shape); jitted, it is one small program per shape, found in a test run's compilation cache by the others.
jitted_reference = jax.jit(ragged_paged_attention_reference,
                           static_argnames=("sm_scale", "soft_cap", "sliding_window"))


def interpreted(kernel):
    """`kernel(*arrays, **options)` (a ragged attention kernel's wrapper) in interpret mode, jitted per set of
    static options with `INTERPRET_COMPILER_OPTIONS`. Array keyword arguments (the quantized pages' scales,
    the span ends) stay arguments of the compiled program."""
    @functools.cache
    def compiled(static: frozenset):
        def call(*arrays, **array_options):
            return kernel(*arrays, interpret=True, **dict(static), **array_options)
        return jax.jit(call, compiler_options=INTERPRET_COMPILER_OPTIONS)

    def run(*arrays, k_scales=None, v_scales=None, span_ends=None, **static):
        return compiled(frozenset(static.items()))(*arrays, k_scales=k_scales, v_scales=v_scales,
                                                   span_ends=span_ends)
    return run


@dataclasses.dataclass
class PagedCase:
    k_pages: np.ndarray  # [num_kv_heads, num_pages, page_size, head_dim] float32
    v_pages: np.ndarray  # [num_kv_heads, num_pages, page_size, head_dim] float32
    page_tables: np.ndarray  # [n, max_pages] int32
    dense_k: np.ndarray  # [n, num_kv_heads, max_pages * page_size, head_dim] float32
    dense_v: np.ndarray  # [n, num_kv_heads, max_pages * page_size, head_dim] float32


def random_paged_case(rng: np.random.Generator, tokens: list[int], *, num_kv_heads: int, page_size: int,
                      head_dim: int, max_pages: int, spare_pages: int = 3) -> PagedCase:
    """Sequences holding `tokens[i]` cached tokens each, scattered over shuffled pages of a shared pool."""
    n = len(tokens)
    need = [-(-t // page_size) for t in tokens]
    if max(need, default=0) > max_pages:
        raise ValueError(f"{max(need)} pages needed but max_pages={max_pages}")
    num_pages = 1 + sum(need) + spare_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = rng.standard_normal(shape).astype(np.float32) * 3.0  # garbage the kernel must mask out
    v_pages = rng.standard_normal(shape).astype(np.float32) * 3.0
    dense_k = rng.standard_normal((n, num_kv_heads, max_pages * page_size, head_dim)).astype(np.float32)
    dense_v = rng.standard_normal((n, num_kv_heads, max_pages * page_size, head_dim)).astype(np.float32)
    pool = list(rng.permutation(np.arange(1, num_pages)))
    page_tables = np.zeros((n, max_pages), np.int32)
    for i in range(n):
        for j in range(need[i]):
            page = pool.pop()
            page_tables[i, j] = page
            k_pages[:, page] = dense_k[i, :, j * page_size:(j + 1) * page_size]
            v_pages[:, page] = dense_v[i, :, j * page_size:(j + 1) * page_size]
    return PagedCase(k_pages, v_pages, page_tables, dense_k, dense_v)


@functools.partial(jax.jit, static_argnames="kv_dtype")
def quantize_pages(k_pages, v_pages, kv_dtype: str) -> tuple[tuple, dict]:
    """Float pages -> ((k codes, v codes), {"k_scales", "v_scales"}) in the `kv_quant` format, every token of
    every page (garbage included) quantized as the write side would have. Jitted: called eagerly, each of its
    operations compiled on its own for every new page shape (a second a case in the kernel sweeps)."""
    dtype = KV_CACHE_DTYPES[kv_dtype]
    (k, k_scales), (v, v_scales) = quantize_kv_tokens(k_pages, dtype), quantize_kv_tokens(v_pages, dtype)
    return (k, v), {"k_scales": lane_dense_scales(k_scales), "v_scales": lane_dense_scales(v_scales)}


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, kv_len: int, *,
                    sm_scale: float, soft_cap: float | None = None, sliding_window: int | None = None,
                    span_ends: np.ndarray | None = None) -> np.ndarray:
    """float64 oracle. q [T, H, D] at positions q_pos [T]; k/v [KVH, L, D] dense -> [T, H, D].

    Row t (a real token only if q_pos[t] < kv_len) attends to keys j with j <= max(q_pos[t], span_ends[t]),
    j < kv_len and q_pos[t] - j < window; padding rows and rows without keys -> zeros."""
    t, h, d = q.shape
    kvh = k.shape[0]
    group = h // kvh
    out = np.zeros((t, h, d), np.float64)
    for r in range(t):
        p = int(q_pos[r])
        if p >= kv_len:
            continue
        hi = min(max(p, -1 if span_ends is None else int(span_ends[r])), kv_len - 1) + 1
        lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
        if hi <= lo:
            continue
        for head in range(h):
            kk = k[head // group, lo:hi].astype(np.float64)
            vv = v[head // group, lo:hi].astype(np.float64)
            s = kk @ q[r, head].astype(np.float64) * sm_scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            w = np.exp(s - s.max())
            out[r, head] = (w / w.sum()) @ vv
    return out


@dataclasses.dataclass
class RaggedCase:
    """One ragged step: sequence s has kv_lens[s] cached tokens, the last q_lens[s] of them new (queries)."""
    q: np.ndarray  # [tokens, num_heads, head_dim] float32; rows past sum(q_lens) are padding
    kv_lens: np.ndarray  # [num_seqs] int32
    cu_q_lens: np.ndarray  # [num_seqs + 1] int32
    paged: PagedCase

    def positions(self, s: int) -> np.ndarray:
        q_len = self.cu_q_lens[s + 1] - self.cu_q_lens[s]
        return np.arange(self.kv_lens[s] - q_len, self.kv_lens[s])


def random_ragged_case(rng: np.random.Generator, q_lens: list[int], kv_lens: list[int], *, num_kv_heads: int,
                       group: int, page_size: int, head_dim: int, max_pages: int,
                       padding_tokens: int = 0) -> RaggedCase:
    """A ragged batch over shuffled pages: a decode is (1, n), a first prefill chunk (n, n), a later chunk
    or a prefix-cache hit (n, m > n), a padding sequence (0, 0). `padding_tokens` rows follow the last one."""
    if any(q > k for q, k in zip(q_lens, kv_lens)):
        raise ValueError("a sequence cannot have more new tokens than cached ones")
    paged = random_paged_case(rng, kv_lens, num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim,
                              max_pages=max_pages)
    tokens = sum(q_lens) + padding_tokens
    q = rng.standard_normal((tokens, num_kv_heads * group, head_dim)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return RaggedCase(q, np.asarray(kv_lens, np.int32), cu, paged)


def ragged_oracle(case: RaggedCase, q: np.ndarray, k_dense: np.ndarray, v_dense: np.ndarray,
                  span_ends: np.ndarray | None = None, **options) -> np.ndarray:
    """float64 attention of every sequence's rows over its dense K/V ([n, KVH, L, D]); padding rows 0."""
    out = np.zeros(q.shape, np.float64)
    for s in range(len(case.kv_lens)):
        lo, hi = case.cu_q_lens[s], case.cu_q_lens[s + 1]
        if hi > lo:
            spans = None if span_ends is None else span_ends[lo:hi]
            out[lo:hi] = dense_attention(q[lo:hi], k_dense[s], v_dense[s], case.positions(s), int(case.kv_lens[s]),
                                         span_ends=spans, **options)
    return out


def image_spans(case: RaggedCase, images: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """span_ends [tokens] int32 for `images`: sequence -> [(first, last)] positions of its images, which may
    start in the cached prefix or end past kv_len (a chunk that stops inside an image). A row inside an image
    gets the image's last position, every other row (padding too) -1."""
    spans = np.full(case.q.shape[0], -1, np.int32)
    for s, runs in images.items():
        lo = case.cu_q_lens[s]
        for row, pos in enumerate(case.positions(s)):
            for first, last in runs:
                if first <= pos <= last:
                    spans[lo + row] = last
    return spans
