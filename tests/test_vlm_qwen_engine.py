"""Qwen2.5-VL images through the engine (`LLM`), against transformers (tests/fixtures/vlm/qwen2_5_vl/golden.npz).

One engine serves the model tests (one step program of 32 tokens; the ViT's two programs of 40 and 160
patches): each fixture conversation (text only, one image, two images in one message, an image in a second
turn) gives the fixture's greedy tokens, and log-probabilities within 1e-4 of log_softmax of transformers'
logits at every prompt and generated position, which holds only if every token's three M-RoPE positions
(time, row, column) are transformers' (`get_rope_index`). The same holds with all four in one batch beside
text requests and on a prefix-cache hit. The token budget of 32 cuts the landscape's 35 image tokens across
chunks: Qwen's image tokens attend causally, so a chunk may end inside an image. Nothing compiles after
warm-up, and the encoder cache and the KV pages come back empty. (Gemma 3: test_vlm_engine.py; the server:
test_vlm_server.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.qwen_images import MRoPEImages
from jaxserve.errors import InvalidParameter
from jaxserve.execution.batch import BatchBuilder, BatchLayout
from jaxserve.execution.vision_patches import patch_buckets
from jaxserve.json_files import read_json_object
from jaxserve.model.mrope import PromptPositions
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from tests.test_vlm_requests import VLM, image_part
from tests.vlm_golden import CASES, Golden, check_nothing_compiles_or_leaks, greedy, recording_llm

FAMILY = "qwen2_5_vl"
GOLDEN = Golden(FAMILY)
PAGE = 8
BUDGET = 32


@pytest.fixture(scope="module")
def llm():
    yield recording_llm(FAMILY, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=BUDGET,
                        token_buckets=(BUDGET,), page_size=PAGE, num_pages=160)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_conversation_matches_transformers(llm, case):
    GOLDEN.check(case, llm.chat(CASES[case], greedy())[0])


def test_images_and_text_in_one_batch(llm):
    GOLDEN.check_batched_with_text(llm)


def test_chunked_prefill_cuts_through_an_image(llm):
    """The landscape's 35 tokens do not fit a step of 32: its rows come in two chunks, each chunk's rows where
    they belong, and the answer is still transformers'."""
    llm.reset_prefix_cache()
    start = len(llm.plans)
    GOLDEN.check("one_image", llm.chat(CASES["one_image"], greedy(prompt=False))[0], prompt_scores=False)
    (offset, length), = GOLDEN.image_offsets("one_image")
    chunks = [(s.start, c.first_row, c.token, c.count) for p in llm.plans[start:] for s in p.seqs for c in s.images]
    assert len(chunks) >= 2 and sum(c[3] for c in chunks) == length == 35
    assert [c[1] for c in chunks] == [sum(c[3] for c in chunks[:i]) for i in range(len(chunks))]  # rows in order
    assert all(s + token == offset + row for s, row, token, _ in chunks)  # each row at its own token


def test_a_repeated_image_hits_the_caches_and_another_image_shares_nothing(llm):
    """A prefix-cache hit through the image: the positions of the tokens after it come from the request,
    not the cache, and the answer is transformers' again."""
    llm.reset_prefix_cache()
    cache = llm.engine.images.cache
    first = llm.chat(CASES["one_image"], greedy(prompt=False))[0]
    encoded = cache.encoded
    again = llm.chat(CASES["one_image"], greedy(prompt=False))[0]
    (offset, length), = GOLDEN.image_offsets("one_image")
    assert again.num_cached_tokens >= offset + length and cache.encoded == encoded
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    GOLDEN.check("one_image", again, prompt_scores=False)
    # The same text with another picture: no page that holds an image token is shared.
    other = [{"role": "user", "content": [image_part(2), {"type": "text", "text": "What is this?"}]}]
    out = llm.chat(other, greedy(prompt=False))[0]
    assert out.num_cached_tokens <= offset // PAGE * PAGE and cache.encoded == encoded + 1


def test_choices_of_one_image_request_share_its_prompt_and_positions(llm):
    out = llm.chat(CASES["second_turn"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2))[0]
    assert [c.token_ids for c in out.outputs] == [GOLDEN["second_turn.greedy"].tolist()] * 2


def test_nothing_compiles_after_warmup_and_nothing_leaks(llm):
    """Images (both of the ViT's patch buckets: the landscape's 140 patches run in the 160 one, the portrait's
    40 in the 40 one), text and both mixed: nothing compiled; the encoder cache holds rows only for images no
    request needs, and lets go of them with the prefix cache."""
    assert llm.engine.images.rows.encoder.buckets == (40, 160)
    llm.reset_prefix_cache()
    check_nothing_compiles_or_leaks(llm)


# ---- the pieces, without a model -------------------------------------------------------------------------

def test_the_language_model_config_reads_both_spellings():
    """transformers 5's nested text_config with rope_parameters, and the hub's flat keys with rope_scaling
    {"type": "mrope"}: the same qwen2 decoder with M-RoPE sections."""
    nested = read_json_object(VLM / FAMILY / "config.json")
    text = nested["text_config"]
    rope = {"type": "mrope", "mrope_section": text["rope_parameters"]["mrope_section"]}
    flat = {**{k: v for k, v in text.items() if k not in ("rope_parameters", "model_type")},
            "model_type": "qwen2_5_vl", "rope_scaling": rope, "rope_theta": 1e6, "vision_config": {}}
    configs = [ModelConfig.from_hf_dict(cfg) for cfg in (nested, flat)]
    assert configs[0] == configs[1]
    assert configs[0].model_type == "qwen2" and configs[0].mrope_section == (2, 3, 3)
    assert configs[0].rope_scaling is None and configs[0].rope_theta == 1e6 and configs[0].attention_bias


def test_positions_come_from_the_request_in_every_span():
    """The batch builder's [3, T] positions for spans of the second-turn prompt (chunks through its image, a
    recomputation running past the prompt into the output, a decode) and of a text-only prompt are
    transformers' (`get_rope_index`); a text-only layout carries none."""
    ids = GOLDEN["second_turn.input_ids"]
    grids = [tuple(GOLDEN[f"image{i}.grid_thw"]) for i in GOLDEN["second_turn.images"]]
    (offset, length), = GOLDEN.image_offsets("second_turn")
    table = PromptPositions.of(ids.tolist(), 5, grids, 2, offset + length)
    assert table.delta == int(GOLDEN["second_turn.rope_delta"])
    expected = GOLDEN["second_turn.positions"]
    after = offset + length + 2
    spans = [(0, offset + 3), (offset + 3, length - 1), (after, len(ids) - after + 5), (len(ids) + 7, 1)]
    builder = BatchBuilder(max_num_seqs=5, max_pages=32, page_size=PAGE)
    layout = BatchLayout(tokens=256, seqs=5, max_pages=32, bias_entries=1, scratch_slot=5, mrope=True)
    seqs = [ScheduledSeq(key=k, epoch=0, slot=k, start=start, num_tokens=n, token_ids=(1,) * n, params=None,
                         new_pages=tuple(range(1, 33)), new_in_slot=True, mrope=table)
            for k, (start, n) in enumerate(spans)]
    seqs.append(ScheduledSeq(key=4, epoch=0, slot=4, start=3, num_tokens=4, token_ids=(1,) * 4, params=None))
    batch = layout.packing.views(*builder.build(StepPlan.of(seqs), layout))
    got, row = batch.mrope_positions, 0
    for start, n in spans:
        np.testing.assert_array_equal(got[:, row:row + n], expected[:, start:start + n])
        row += n
    np.testing.assert_array_equal(got[:, row:row + 4], np.broadcast_to(np.arange(3, 7), (3, 4)))
    text_layout = dataclasses.replace(layout, mrope=False)
    assert text_layout.packing.views(*text_layout.empty()).mrope_positions is None
    assert text_layout.packing.int_size == layout.packing.int_size - 3 * 256


def test_patch_buckets_and_an_image_past_the_largest_is_refused_by_its_field():
    assert patch_buckets(16, 160, 4) == (40, 160)  # the fixture: min_pixels 3136, max_pixels 31360
    assert patch_buckets(16, 5120, 4) == (20, 80, 320, 1280, 5120)  # Qwen's processor defaults
    images = MRoPEImages(image_token_id=5, spatial_merge_size=2, max_patches=160, patch_size=14)
    big = type("Image", (), {"pixel_values": np.zeros((164, 1176), np.float32), "grid_thw": (1, 2, 82),
                             "field": "messages.0.content.1.image_url.url"})()
    with pytest.raises(InvalidParameter, match="164 patches .* more than the 160") as refused:
        images.pixels(big)
    assert refused.value.param == "messages.0.content.1.image_url.url"
