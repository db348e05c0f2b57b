"""Bidirectional spans in ragged paged attention (`span_ends`, Gemma 3's image tokens): every implementation
against `ragged_paged_attention_reference`, and the reference against a float64 oracle over dense K/V.

A case is a ragged step (tests/test_pallas_ragged.py's `Case`) plus images: per sequence, runs of positions
that attend bidirectionally. They are placed where kernels cut their work: across page and key-block
boundaries, starting in the cached prefix, ending past kv_len (a chunk that stops inside an image, whose
unwritten keys must stay invisible although the pages hold garbage there), longer than a sliding window,
and beside decode rows and padding. One case gives every row a random span instead, the contract in full
generality (spans need not be images). Shapes stay tiny: the kernels run in interpret mode.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu
from pallas_kernels.testing import image_spans, interpreted, quantize_pages, ragged_oracle
from tests.test_pallas_ragged import (IMPLEMENTATIONS, SMALL_BLOCKS, Case, _assert_close, _assert_padding_zero,
                                      _options, _setup, reference)


@dataclasses.dataclass(frozen=True)
class SpanCase:
    case: Case
    images: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()  # (sequence, ((first, last), ...))
    random_spans: bool = False  # every row a random span end in [-1, kv_len + 3] instead of images

    @property
    def id(self) -> str:
        return self.case.id

    def setup(self):
        args, ragged = _setup(self.case)
        if self.random_spans:
            rng = np.random.default_rng(1)
            spans = rng.integers(-1, int(ragged.kv_lens.max()) + 4, size=ragged.q.shape[0]).astype(np.int32)
        else:
            spans = image_spans(ragged, {s: list(runs) for s, runs in self.images})
        return args, ragged, spans


SPAN_CASES = [
    # An image over positions 10..15 crosses two page boundaries (4-token pages) inside a chunk; a short
    # image at the start of a whole prompt; a decode row and padding rows beside them.
    SpanCase(Case("image-in-chunk", ((12, 20), (1, 9), (7, 7)), group=2, page_size=4, max_pages=6,
                  padding_tokens=2), ((0, ((10, 15),)), (2, ((1, 3),)))),
    # Images that start in the cached prefix (3..7, chunk rows from 5) and run past kv_len (11..19 with
    # kv_len 14; 4..9 with kv_len 6): the keys past kv_len are unwritten garbage and must stay hidden.
    SpanCase(Case("image-straddles-chunk", ((9, 14), (6, 6), (1, 5)), dtype="bfloat16", group=4, page_size=4,
                  max_pages=6, padding_tokens=1), ((0, ((3, 7), (11, 19))), (1, ((0, 2), (4, 9))))),
    # An image longer than the sliding window: its later keys are all visible (transformers: k > p - window
    # holds for k > p), its earlier ones only inside the window; with a soft cap.
    SpanCase(Case("image-window-cap", ((16, 24), (1, 13)), group=2, page_size=8, max_pages=4, sliding_window=4,
                  soft_cap=2.0), ((0, ((10, 19),)),)),
    # Small key blocks and the smallest query tiles: the chunk's rows sit at positions 39..59, and each image
    # reaches a key block past the last row of the tile holding its first rows (Triton: 8-token tiles over
    # 16-key blocks, 39..46 needing 49; Mosaic: a 16-token block ending at 54 needing 57 in 4-key blocks;
    # blocked jnp: 4-row windows over 4-key blocks).
    SpanCase(Case("image-many-blocks", ((21, 60), (1, 30), (11, 11)), group=2, page_size=4, max_pages=16,
                  padding_tokens=3, sliding_window=9, blocks=True), ((0, ((42, 49), (53, 57))), (2, ((2, 9),)))),
    SpanCase(Case("random-spans", ((13, 21), (1, 7), (6, 10)), group=2, page_size=4, max_pages=6,
                  padding_tokens=2, blocks=True), random_spans=True),
]
# The multiply-and-sum flavour of the blocked path differs only in its decode rows, which spans never widen.
SPAN_IMPLEMENTATIONS = ["blocked", "pallas-triton", "pallas-mosaic"]


def _run(impl: str, span_case: SpanCase, args, spans, **extra):
    blocks = SMALL_BLOCKS[impl] if span_case.case.blocks else {}
    return IMPLEMENTATIONS[impl](*args, **_options(span_case.case), **blocks, **extra, span_ends=jnp.asarray(spans))


@pytest.mark.parametrize("span_case", SPAN_CASES, ids=[c.id for c in SPAN_CASES])
def test_reference_spans_match_float64_oracle(span_case):
    args, ragged, spans = span_case.setup()
    case = span_case.case
    want = reference(*args, **_options(case), span_ends=jnp.asarray(spans))
    rounded = lambda x: np.asarray(jnp.asarray(x, case.dtype), np.float32)
    oracle = ragged_oracle(ragged, rounded(ragged.q), rounded(ragged.paged.dense_k), rounded(ragged.paged.dense_v),
                           span_ends=spans, **_options(case))
    _assert_close(want, oracle, case.dtype)
    _assert_padding_zero(want, ragged.cu_q_lens)
    causal = reference(*args, **_options(case))
    assert not np.allclose(np.asarray(want, np.float32), np.asarray(causal, np.float32)), "spans changed nothing"


@pytest.mark.parametrize("impl", SPAN_IMPLEMENTATIONS)
@pytest.mark.parametrize("span_case", SPAN_CASES, ids=[c.id for c in SPAN_CASES])
def test_spans_match_reference(impl, span_case):
    args, ragged, spans = span_case.setup()
    got = _run(impl, span_case, args, spans)
    assert got.shape == args[0].shape and got.dtype == args[0].dtype
    _assert_close(got, reference(*args, **_options(span_case.case), span_ends=jnp.asarray(spans)),
                  span_case.case.dtype)
    _assert_padding_zero(got, ragged.cu_q_lens)


@pytest.mark.parametrize("impl", SPAN_IMPLEMENTATIONS)
def test_spans_over_quantized_pages(impl):
    span_case = SPAN_CASES[1]  # images that start in the prefix and run past kv_len
    args, _, spans = span_case.setup()
    (k, v), scales = quantize_pages(args[1], args[2], "int8")
    args = (args[0], k, v) + args[3:]
    want = reference(*args, **_options(span_case.case), **scales, span_ends=jnp.asarray(spans))
    _assert_close(_run(impl, span_case, args, spans, **scales), want, span_case.case.dtype)


def test_triton_split_kv_walks_to_the_span_end():
    """Split-K shares out an item's key blocks up to its furthest span end: 3 splits of one-page blocks, the
    spans' keys falling in later splits than the rows' own positions."""
    span_case = SPAN_CASES[3]  # image-many-blocks
    args, _, spans = span_case.setup()
    got = interpreted(ragged_paged_attention_gpu)(*args, **_options(span_case.case), **SMALL_BLOCKS["pallas-triton"],
                                                  num_kv_splits=3, min_keys_per_split=1, span_ends=jnp.asarray(spans))
    _assert_close(got, reference(*args, **_options(span_case.case), span_ends=jnp.asarray(spans)),
                  span_case.case.dtype)


@pytest.mark.parametrize("impl", SPAN_IMPLEMENTATIONS)
def test_text_only_spans_are_causal(impl):
    """Rows without a span (-1) or with a span end at or before their own position attend causally."""
    span_case = SPAN_CASES[0]
    args, ragged, _ = span_case.setup()
    positions = np.concatenate([ragged.positions(s) for s in range(len(ragged.kv_lens))])
    spans = np.full(args[0].shape[0], -1, np.int32)
    spans[:len(positions)] = np.where(np.arange(len(positions)) % 2, positions, -1)
    _assert_close(_run(impl, span_case, args, spans), reference(*args, **_options(span_case.case)),
                  span_case.case.dtype)


@pytest.mark.parametrize("impl", SPAN_IMPLEMENTATIONS + ["blocked-multiply-sum", "reference"])
@pytest.mark.parametrize("spans,match", [(jnp.zeros((5,), jnp.int32), "span_ends must be \\[tokens=6\\]"),
                                         (jnp.zeros((6,), jnp.float32), "span_ends must be an integer")],
                         ids=["shape", "dtype"])
def test_span_validation_errors(impl, spans, match):
    kv = jnp.zeros((2, 6, 8, 64), jnp.float32)
    args = (jnp.zeros((6, 4, 64), jnp.float32), kv, kv, jnp.array([3, 4]), jnp.zeros((2, 3), jnp.int32),
            jnp.array([0, 2, 6]))
    fn = reference if impl == "reference" else IMPLEMENTATIONS[impl]
    with pytest.raises(ValueError, match=match):
        fn(*args, sm_scale=0.1, span_ends=spans)
