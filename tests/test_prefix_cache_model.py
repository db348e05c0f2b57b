"""Prefix caching on the real stories260K model: identical greedy tokens with and without it, and under
a page pool far too small for the load (preemption, eviction and re-hits), with nothing leaked."""

import random

import pytest

from jaxserve import LLM, SamplingParams
from tests.page_checks import assert_pages_released

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball.")
PAGE = 8


@pytest.fixture(scope="module")
def pair(stories_dir):
    """Two engines identical but for prefix caching."""
    kw = dict(max_num_seqs=4, max_model_len=256, page_size=PAGE, max_num_batched_tokens=64, token_buckets=(4, 64))
    return LLM(str(stories_dir), **kw), LLM(str(stories_dir), enable_prefix_caching=False, **kw)


def greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n)


def test_outputs_identical_with_and_without_prefix_caching(pair):
    cached, plain = pair
    cached.reset_prefix_cache()
    tok = cached.get_tokenizer()
    system = tok.encode(STORY)
    assert len(system) % PAGE, "the shared prefix should end mid-page"
    cases = [  # (prompt, expected hit in tokens, what it exercises)
        (system + tok.encode(" She ran", add_special_tokens=False), 0, "cold: fills the cache"),
        (system + tok.encode(" The ball", add_special_tokens=False), len(system) // PAGE * PAGE,
         "shared prefix ending mid-page"),
        (system, (len(system) - 1) // PAGE * PAGE, "whole prompt cached: the last token is recomputed"),
        (system[:4 * PAGE], 3 * PAGE, "whole prompt cached, a page multiple: its last page is recomputed"),
        (system[:2 * PAGE + 3] + tok.encode(" Tom", add_special_tokens=False), 2 * PAGE,
         "diverges mid-page inside the prefix"),
    ]
    outputs = []
    for prompt, hit, why in cases:
        out = cached.generate([prompt], greedy())[0]
        assert out.num_cached_tokens == hit, why
        outputs.append(out.outputs[0].token_ids)
    # Multi-turn: the first answer's generated tokens are cached too.
    turn2 = cases[0][0] + outputs[0] + tok.encode(" Then", add_special_tokens=False)
    out = cached.generate([turn2], greedy())[0]
    assert out.num_cached_tokens >= (len(cases[0][0]) + len(outputs[0]) - 1) // PAGE * PAGE
    outputs.append(out.outputs[0].token_ids)
    prompts = [c[0] for c in cases] + [turn2]
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy())]
    assert outputs == expected
    # All at once, with the cache warm: shared pages are read by several running requests together.
    together = cached.generate(prompts, greedy())
    assert [o.outputs[0].token_ids for o in together] == expected
    assert all(o.num_cached_tokens > 0 for o in together)
    assert plain.engine.scheduler.prefix_cache_hits == 0
    assert_pages_released(cached.engine.scheduler)


def test_tiny_pool_under_4x_overload_completes_everything_identically(stories_dir):
    """64 concurrent greedy requests needing 4x the pool: preemption and eviction under pressure, each
    request still gives the tokens it gives alone, and every page comes back."""
    # Two programs: one request decoding alone, and anything larger.
    kw = dict(max_num_seqs=64, max_model_len=64, page_size=4, max_num_batched_tokens=64, token_buckets=(1, 64))
    rng = random.Random(0)
    systems = [[1] + [rng.randint(3, 511) for _ in range(n - 1)] for n in (9, 14, 20, 24)]
    prompts, params = [], []
    for i in range(64):
        prompt = systems[i % 4] + [rng.randint(3, 511) for _ in range(rng.randint(0, 8))]
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0, ignore_eos=True, max_tokens=64 - len(prompt) - rng.randint(0, 12)))
    need = sum(-(-(len(p) + s.max_tokens) // 4) for p, s in zip(prompts, params))  # pages, all at once
    num_pages = need // 4 + 1
    llm = LLM(str(stories_dir), num_pages=num_pages, **kw)
    outs = llm.generate(prompts, params)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.prefix_cache_hits > 0
    assert [len(o.outputs[0].token_ids) for o in outs] == [s.max_tokens for s in params]
    assert_pages_released(scheduler)

    # Alone: the same shapes without the cache, one request at a time.
    alone_llm = LLM(str(stories_dir), num_pages=num_pages, enable_prefix_caching=False, **kw)
    alone = [alone_llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(prompts, params)]
    assert alone_llm.engine.scheduler.num_preemptions == 0
    assert [o.outputs[0].token_ids for o in outs] == alone
