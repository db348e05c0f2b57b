"""The on-device sampler: every setting per row, in one program, reproducible per seed."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.sampling.params import seed_words
from jaxserve.sampling.sampler import sample, SamplingArrays

VOCAB = 16
LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02] + [1e-9] * (VOCAB - 7), np.float32))

sample_jit = jax.jit(sample)


@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """One row of SamplingArrays."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    step: int = 0


def pack_sampling(rows: list[SlotSampling]) -> SamplingArrays:
    column = lambda name, dtype: np.array([getattr(r, name) for r in rows], dtype)
    return SamplingArrays(temperature=column("temperature", np.float32), top_k=column("top_k", np.int32),
                          top_p=column("top_p", np.float32), min_p=column("min_p", np.float32),
                          seed=np.array([seed_words(r.seed) for r in rows], np.uint32).reshape(len(rows), 2),
                          step=column("step", np.int32))


def draw(rows: list[SlotSampling], logits=LOGITS) -> np.ndarray:
    batch = np.stack([logits] * len(rows))
    return np.asarray(sample_jit(batch, pack_sampling(rows)))


def draw_many(row: SlotSampling, n: int = 2000) -> np.ndarray:
    """n draws of one setting: n rows with consecutive token indices (steps)."""
    rows = [SlotSampling(**{**row.__dict__, "step": i}) for i in range(n)]
    return draw(rows)


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = np.array(LOGITS)
    logits[3] = 5.0
    out = draw([SlotSampling(temperature=0), SlotSampling(temperature=1.0, seed=1), SlotSampling(temperature=0)],
               logits)
    assert out[0] == out[2] == 3


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draw_many(SlotSampling(temperature=1.0, seed=3)), minlength=VOCAB) / 2000
    np.testing.assert_allclose(counts[:4], [0.4, 0.25, 0.15, 0.1], atol=0.04)


def test_low_temperature_sharpens():
    counts = np.bincount(draw_many(SlotSampling(temperature=0.2, seed=3)), minlength=VOCAB) / 2000
    assert counts[0] > 0.9


def test_top_k_limits_the_support():
    out = draw_many(SlotSampling(temperature=1.0, top_k=2, seed=5))
    assert set(out.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    out = draw_many(SlotSampling(temperature=1.0, top_p=0.6, seed=5))  # 0.4 + 0.25 >= 0.6
    assert set(out.tolist()) == {0, 1}
    assert set(draw_many(SlotSampling(temperature=1.0, top_p=0.01, seed=5)).tolist()) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    out = draw_many(SlotSampling(temperature=1.0, min_p=0.3, seed=5))  # keeps p >= 0.12: tokens 0, 1, 2
    assert set(out.tolist()) == {0, 1, 2}


def test_seed_and_step_fix_the_draw_whatever_the_batch():
    row = SlotSampling(temperature=1.0, seed=1234, step=7)
    alone = draw([row])[0]
    crowd = draw([SlotSampling(temperature=0.5, seed=9), row, SlotSampling(temperature=0)])[1]
    assert alone == crowd
    seeds = {int(draw([SlotSampling(temperature=1.0, seed=s, step=7)])[0]) for s in range(40)}
    assert len(seeds) > 2  # different seeds do differ


def test_a_row_without_filters_draws_the_same_whether_neighbours_filter_or_not():
    """Only a batch where some row sets top-k/top-p/min-p pays for the sort; a row that sets none must not
    notice which branch ran (top_p = 1 keeps every token, even where the cumulative mass rounds to 1)."""
    logits = np.random.default_rng(0).normal(0, 0.01, 32000).astype(np.float32)
    rows = [SlotSampling(temperature=1.0, seed=s, step=3) for s in range(64)]
    alone = draw(rows, logits)
    with_filtering_neighbour = draw(rows + [SlotSampling(temperature=1.0, top_k=5, seed=1)], logits)[:64]
    np.testing.assert_array_equal(alone, with_filtering_neighbour)
    assert len(set(alone.tolist())) > 50  # the draws spread over the flat distribution


@pytest.mark.parametrize("big_seed", [2**40 + 5, 2**63 - 1])
def test_64_bit_seeds_are_accepted(big_seed):
    assert 0 <= draw([SlotSampling(temperature=1.0, seed=big_seed)])[0] < VOCAB


@pytest.mark.parametrize("last_row", ["top_k", "top_p_closed", "top_p_open", "min_p_closed"])
def test_candidates_from_top_k_keep_what_the_vocabulary_sort_keeps(monkeypatch, last_row):
    """Rows whose filters provably stop within the best few candidates take them from lax.top_k (a 262k
    sort is 30x slower): a small top_k, a top_p the candidates' mass reaches, a min_p cut above the last
    candidate; otherwise the step sorts. Either way the kept tokens are those of the full sort."""
    from jaxserve.sampling import sampler
    monkeypatch.setattr(sampler, "TOP_K_CANDIDATES", 8)
    logits = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32) * 2
    logits[3, :4] += 8  # a peaked row: its first 8 candidates hold nearly all the mass
    last = {"top_k": SlotSampling(1.0, top_k=3), "top_p_closed": SlotSampling(1.0, top_p=0.9),
            "top_p_open": SlotSampling(1.0, top_p=0.999999), "min_p_closed": SlotSampling(1.0, min_p=0.01)}[last_row]
    rows = [SlotSampling(1.0, top_k=5, top_p=0.7), SlotSampling(1.0, top_k=8, min_p=0.2), SlotSampling(1.0), last]
    params = pack_sampling(rows)
    got = np.asarray(sampler._kept_by_filters(logits, params))
    want = np.asarray(sampler._kept_among(logits, params, *sampler._sorted(logits)))
    filtering = [0, 1, 3]  # the sampler ignores what the filters say of row 2 (it sets none)
    np.testing.assert_array_equal(got[filtering], want[filtering])
    assert got[0].sum() <= 5 and got[3].sum() >= 1
