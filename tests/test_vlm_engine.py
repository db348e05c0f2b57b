"""Gemma 3 images through the engine (`LLM`), against transformers (tests/fixtures/vlm/gemma3/golden.npz).

One engine serves every test here (one step program of 32 tokens, the vision encoder's two: 1 and 2 images a call): each fixture
conversation (text only, one image, two images in one message, an image in the second turn) gives the
fixture's greedy tokens, and log-probabilities within 1e-4 of log_softmax of transformers' logits, for
every prompt token and every generated one (the engine's logits, seen through the draws it returns). The
same holds with all four in one batch beside text requests, and on a prefix-cache hit. The token budget of
32 makes the scheduler chunk every prompt, and the two-image prompt's first chunk would end inside its
second image: it stops before it instead (Gemma 3's image tokens attend to each other). Nothing compiles
after warm-up, and the encoder cache and the KV pages come back empty. (The server's path: test_vlm_server.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.engine.images import encoder_batch_sizes, encoder_budget, images_refusal
from jaxserve.engine_args import EngineArgs
from jaxserve.errors import InvalidParameter
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.encoder_cache import EncoderCache
from jaxserve.scheduling.images import ImageScheduling, ImageSpan, fit_chunk, image_chunks, page_extras
from tests.page_checks import assert_pages_released
from tests.test_scheduler import AsyncLoop, make_scheduler, request
from tests.test_vlm_requests import VLM, image_part
from tests.vlm_golden import CASES, Golden, check_nothing_compiles_or_leaks, greedy, recording_llm

GOLDEN = Golden("gemma3")
check_against_golden = GOLDEN.check
PAGE = 8


@dataclasses.dataclass
class ImagePrompt:  # the fields the engine reads of a `multimodal.prompt.PromptImage`
    offset: int
    length: int
    content_hash: str = "h"
    pixel_values: object = None
    field: str = "messages.0.content.0.image_url.url"


@pytest.fixture(scope="module")
def llm():
    yield recording_llm("gemma3", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
                        page_size=PAGE, num_pages=96)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_conversation_matches_transformers(llm, case):
    check_against_golden(case, llm.chat(CASES[case], greedy())[0])


def test_images_and_text_in_one_batch(llm):
    GOLDEN.check_batched_with_text(llm)


def test_a_repeated_image_hits_the_caches_and_another_image_shares_nothing(llm):
    llm.reset_prefix_cache()
    cache = llm.engine.images.cache
    first = llm.chat(CASES["one_image"], greedy(prompt=False))[0]
    encoded = cache.encoded
    again = llm.chat(CASES["one_image"], greedy(prompt=False))[0]
    image = next(i for i in range(60) if GOLDEN["one_image.token_type_ids"][i])  # the image's first token
    # The pages through the image (and past it) came from the cache; the encoder did not run again.
    assert again.num_cached_tokens >= image + 16 and cache.encoded == encoded
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for a, b in zip(again.outputs[0].logprobs, first.outputs[0].logprobs):
        assert {t: e.logprob for t, e in a.items()} == pytest.approx({t: e.logprob for t, e in b.items()}, abs=1e-5)
    check_against_golden("one_image", again, prompt_scores=False)
    # The same text with another picture: no page that holds an image token is shared.
    other = [{"role": "user", "content": [image_part(2), {"type": "text", "text": "What is this?"}]}]
    out = llm.chat(other, greedy(prompt=False))[0]
    assert out.num_cached_tokens <= image // PAGE * PAGE and cache.encoded == encoded + 1


def test_chunks_end_before_an_image_never_inside_it(llm):
    """Gemma 3's image tokens see each other: a chunk that would end inside an image stops before it, and
    every image is computed in one step (with a budget of 32, the second-turn prompt's second chunk would
    take its tokens 32..63 and cut its image, which starts at 61)."""
    llm.reset_prefix_cache()
    start = len(llm.plans)
    check_against_golden("second_turn", llm.chat(CASES["second_turn"], greedy(prompt=False))[0],
                         prompt_scores=False)
    spans = [s for plan in llm.plans[start:] for s in plan.seqs if s.is_prefill]
    types = GOLDEN["second_turn.token_type_ids"]
    offset = int(np.argmax(types))
    assert offset % 32 and [(s.start, s.num_tokens) for s in spans] == [(0, 32), (32, offset - 32),
                                                                        (offset, len(types) - offset)]
    assert [(c.first_row, c.token, c.count) for s in spans for c in s.images] == [(0, 0, 16)]


def test_choices_of_one_image_request_share_its_prompt(llm):
    """n = 2: the second choice starts from the first one's prompt pages (the image's among them) and draws
    the same greedy tokens."""
    out = llm.chat(CASES["one_image"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))[0]
    assert [c.token_ids for c in out.outputs] == [GOLDEN["one_image.greedy"].tolist()] * 2


def test_an_image_too_large_for_a_step_is_refused_by_its_field(llm):
    images = llm.engine.images
    too_long = ImagePrompt(offset=0, length=images.scheduling.rows_per_step + 1)
    with pytest.raises(InvalidParameter, match="more than the 32 encoder rows") as refused:
        llm.engine.check_request(list(range(40)), greedy(), images=[too_long])
    assert refused.value.param == "messages.0.content.0.image_url.url"


def test_nothing_compiles_after_warmup_and_nothing_leaks(llm):
    """After the others (module order; under xdist this worker may have run none of them, so the test runs
    images, text and both mixed itself): nothing compiled; the encoder cache holds rows only for images no
    request needs, and lets go of them with the prefix cache."""
    check_nothing_compiles_or_leaks(llm)


def test_the_pallas_kernel_takes_the_image_spans_too(monkeypatch):
    """The Triton-flavoured Pallas kernel (interpret mode on CPU) through the engine: the golden tokens for an
    image at the start and one in the second turn, chunked by a budget of 16, and nothing compiled after
    warm-up. (Its span code is tested against the reference in tests/test_attention_spans.py.)"""
    from jaxserve import LLM
    from pallas_kernels import CPU_FLAVOUR_ENV
    monkeypatch.setenv(CPU_FLAVOUR_ENV, "triton")
    llm = LLM(str(VLM / "gemma3"), attention_backend="pallas", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16, token_buckets=(16,))
    assert llm.engine.runner.attention.name == "pallas-triton (interpret)"
    for case in ("one_image", "second_turn"):
        out = llm.chat(CASES[case], greedy(logprobs=False, prompt=False))[0]
        assert out.outputs[0].token_ids == GOLDEN[f"{case}.greedy"].tolist(), case
    assert llm.engine.compilations_since_warmup == 0


def test_the_encoder_flags_change_the_steps_and_the_cache():
    """--max-num-encoder-input-tokens 16 (one image a step): the two images of one message go in two steps and
    the tokens are still transformers'; --mm-encoder-cache-gb 0: no rows are kept once the request is done,
    so the same image is encoded again."""
    from jaxserve import LLM
    llm = LLM(str(VLM / "gemma3"), max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
              token_buckets=(32,), page_size=PAGE, max_num_encoder_input_tokens=16, mm_encoder_cache_gb=0,
              enable_prefix_caching=False)
    assert llm.engine.images.rows.encoder.buckets == (1,)
    plans, schedule = [], llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    check_against_golden("two_images", llm.chat(CASES["two_images"], greedy(prompt=False))[0], prompt_scores=False)
    per_step = [sum(c.count for s in plan.seqs for c in s.images) for plan in plans]
    assert sorted(n for n in per_step if n) == [16, 16]  # one image a step
    cache = llm.engine.images.cache
    assert cache.num_entries == 0 and cache.encoded == 2
    llm.chat(CASES["one_image"], greedy(logprobs=False, prompt=False))
    llm.chat(CASES["one_image"], greedy(logprobs=False, prompt=False))
    assert cache.encoded == 4 and cache.hits == 0 and llm.engine.compilations_since_warmup == 0


def test_the_encoder_budget_and_its_batch_sizes():
    default = EngineArgs()
    assert encoder_budget(default, 2048, 256) == 1024 and encoder_budget(default, 512, 256) == 512
    assert encoder_budget(default, 128, 256) == 128  # under one image: images are refused at request time
    assert encoder_budget(EngineArgs(max_num_encoder_input_tokens=256), 2048, 256) == 256
    for budget in (255, 4096):
        with pytest.raises(ValueError, match="between 256 and max_num_batched_tokens"):
            encoder_budget(EngineArgs(max_num_encoder_input_tokens=budget), 2048, 256)
    assert [encoder_batch_sizes(n) for n in (0, 1, 2, 4, 6)] == [(1,), (1,), (1, 2), (1, 2, 4), (1, 2, 4, 6)]


# ---- the pieces, without a model -------------------------------------------------------------------------

IMAGES = (ImageSpan(4, 16, "a"), ImageSpan(24, 16, "b"))


@pytest.mark.parametrize("start, n, rows, whole, fitted", [
    (0, 32, 64, True, 24),  # would end inside b: stops before it
    (0, 32, 64, False, 32),  # a causal model cuts through
    (0, 10, 64, True, 4),  # would end inside a
    (24, 8, 64, True, 0),  # starts at b, which does not fit: nothing this step
    (0, 48, 20, True, 24),  # b's rows are over the encoder budget
    (0, 48, 20, False, 28),  # a causal model takes the 4 rows of b that fit
    (0, 48, 10, False, 14),  # a causal model takes what fits of a
    (10, 20, 64, True, 14),  # from inside a (after a prefix hit): a's rest, and stops before b
])
def test_fit_chunk(start, n, rows, whole, fitted):
    assert fit_chunk(IMAGES, start, n, rows, whole) == fitted


def test_image_chunks_and_page_keys():
    assert [(c.content_hash, c.first_row, c.token, c.count, c.last_position) for c in image_chunks(IMAGES, 10, 20)] \
        == [("a", 6, 0, 10, 19), ("b", 0, 14, 6, 39)]
    extras = page_extras(IMAGES, 8)
    assert extras(0) == extras(2) == ("image", "a", 4) and extras(3) == ("image", "b", 24) and extras(5) == ()


def test_encoder_cache_keeps_idle_rows_within_its_bytes():
    cache = EncoderCache(max_bytes=2 * 64)
    span = lambda h: ImageSpan(0, 4, h, pixels=f"pixels of {h}")
    cache.acquire(1, [span("a"), span("b")])
    assert cache.missing(["a", "b", "a"]) == ["a", "b"] and cache.pixels("b") == "pixels of b"
    cache.store("a", np.zeros((4, 4), np.float32))
    cache.store("b", np.zeros((4, 4), np.float32))
    cache.acquire(2, [span("a")])
    assert cache.hits == 1 and cache.missing(["a"]) == []
    cache.release(1, ["a", "b"])
    assert cache.num_referenced == 1 and cache.num_entries == 2  # b idle, within the limit
    cache.acquire(3, [span("c")])
    cache.store("c", np.zeros((4, 4), np.float32))  # over the limit: the idle b goes, a and c are in use
    assert cache.num_entries == 2 and cache.missing(["a", "c"]) == []
    cache.release(2, ["a"])
    cache.release(3, ["c"])
    cache.acquire(4, [span("d")])
    cache.release(4, ["d"])  # never encoded: dropped at once
    assert cache.clear_idle() == 2 and cache.num_entries == 0


def test_a_family_whose_images_are_not_run_is_named():
    assert "Qwen2-VL's encoder is not built" in images_refusal("qwen", "qwen2_vl", "messages.0.content.0.image_url.url")
    assert "text-only" in images_refusal("tiny", None, "f")


def _image_request(name: str, content_hash: str, max_tokens: int = 8):
    """6 prompt tokens, 4 of them an image's."""
    r = request(name, 6, max_tokens)
    r.images = (ImageSpan(1, 4, content_hash),)
    return r


def test_the_scheduler_keeps_images_whole_through_a_preemption_and_lets_go_of_their_rows():
    """2 slots, 5 usable pages of 4 tokens: the newer request is preempted and recomputed; every chunk holds
    its image whole, both times, and the images' references end with their requests."""
    scheduler = make_scheduler(max_num_seqs=2, budget=16, num_pages=6)
    cache = EncoderCache(max_bytes=1 << 20)
    scheduler.images = ImageScheduling(cache, rows_per_step=16, whole_images=True)
    loop = AsyncLoop(scheduler)
    old, new = _image_request("old", "a"), _image_request("new", "b")
    loop.add(old, new)
    assert cache.num_referenced == 2
    for _ in range(60):
        loop.step()
        if old.finished and new.finished:
            break
    assert old.finished and new.finished and scheduler.num_preemptions >= 1
    chunks = [(s.key, c.first_row, c.token, c.count) for p in loop.plans for s in p.seqs for c in s.images]
    assert {(k, row, n) for k, row, _, n in chunks} == {(old.key, 0, 4), (new.key, 0, 4)}
    assert sum(k == new.key for k, *_ in chunks) >= 2  # computed again after the preemption
    loop.step()
    assert_pages_released(scheduler)
    assert cache.num_referenced == 0 and cache.num_entries == 0  # never encoded here: dropped at release


def test_the_encoder_budget_bounds_the_image_rows_of_a_step():
    scheduler = make_scheduler(budget=64)
    scheduler.images = ImageScheduling(EncoderCache(max_bytes=1 << 20), rows_per_step=8, whole_images=True)
    loop = AsyncLoop(scheduler)
    loop.add(*(_image_request(f"r{i}", f"h{i}", max_tokens=1) for i in range(3)))
    first = loop.step()
    assert sum(c.count for s in first.seqs for c in s.images) == 8  # two images of 4 rows; the third waits
    assert [s.num_tokens for s in first.seqs] == [6, 6, 1]  # its text before the image still comes
