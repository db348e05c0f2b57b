"""Image preprocessing and prompt expansion (jaxserve/multimodal/processors.py) against what transformers'
processors produced for the tiny Gemma 3 and Qwen2.5-VL checkpoints (tests/fixtures/vlm, made by
tools/make_vlm_fixtures.py): the same pixel values, patch grids, prompt tokens and image-token runs."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from jaxserve.errors import InvalidParameter
from jaxserve.multimodal.processors import (Gemma3ImageProcessor, QwenVLImageProcessor, image_processor,
                                            smart_resize)

VLM = Path(__file__).parent / "fixtures" / "vlm"
FAMILIES = ("gemma3", "qwen2_5_vl")
IMAGE_NAMES = ("landscape", "rgba", "portrait")
CASES = ("text_only", "one_image", "two_images", "second_turn")


@pytest.fixture(scope="module")
def images():
    return [Image.open(VLM / "images" / f"{name}.png") for name in IMAGE_NAMES]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    directory = VLM / request.param
    return request.param, directory, dict(np.load(directory / "golden.npz"))


def test_the_checkpoints_processor_files_are_read(family):
    name, directory, _ = family
    processor = image_processor(directory)
    if name == "gemma3":
        assert isinstance(processor, Gemma3ImageProcessor)
        assert (processor.size, processor.tokens_per_image, processor.image_token_id) == (64, 16, 8)
        assert (processor.placeholder, processor.image_token) == ("<start_of_image>", "<image_soft_token>")
    else:
        assert isinstance(processor, QwenVLImageProcessor)
        assert (processor.min_pixels, processor.max_pixels, processor.image_token_id) == (3136, 31360, 5)
        assert processor.placeholder == processor.image_token == "<|image_pad|>"


def test_pixels_match_the_processor(family, images):
    """RGB conversion (alpha onto white, grey expanded), resize, rescale and normalize, and Qwen's patching."""
    name, directory, golden = family
    processor = image_processor(directory)
    for i, image in enumerate(images):
        processed = processor.preprocess(image)
        expected = golden[f"image{i}.pixel_values"]
        assert processed.pixel_values.dtype == np.float32 and processed.pixel_values.shape == expected.shape
        np.testing.assert_allclose(processed.pixel_values, expected, rtol=0, atol=1e-6)
        if name == "qwen2_5_vl":
            assert processed.grid_thw == tuple(golden[f"image{i}.grid_thw"])
            assert processed.num_tokens == expected.shape[0] // 4
        else:
            assert processed.num_tokens == 16


def test_prompts_expand_and_tokenize_as_the_processor(family, images):
    name, directory, golden = family
    processor = image_processor(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    type_ids = "token_type_ids"
    for case in CASES:
        processed = [processor.preprocess(images[i]) for i in golden[f"{case}.images"]]
        prompt = processor.expand_prompt(str(golden[f"{case}.prompt"]), processed)
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        assert ids == golden[f"{case}.input_ids"].tolist(), case
        ranges = processor.placeholder_ranges(ids, processed)
        marked = np.zeros(len(ids), np.int32)
        for offset, length in ranges:
            marked[offset:offset + length] = 1
        assert marked.tolist() == golden[f"{case}.{type_ids}"].tolist(), case
        assert [length for _, length in ranges] == [p.num_tokens for p in processed]


def test_mismatched_placeholders_are_refused(family, images):
    name, directory, golden = family
    processor = image_processor(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    image = processor.preprocess(images[1])
    prompt = str(golden["one_image.prompt"])
    with pytest.raises(InvalidParameter, match="1 image placeholders .* for 2 images") as info:
        processor.expand_prompt(prompt, [image, image], field="messages")
    assert info.value.param == "messages"
    # The image token typed into the text: refused when expanding (Qwen: it is the placeholder too) or when
    # the runs of image tokens no longer match the images (Gemma 3).
    typed = prompt.replace("What", processor.image_token + "What")
    with pytest.raises(InvalidParameter, match="2 image placeholders|do not match its 1 images"):
        expanded = processor.expand_prompt(typed, [image])
        processor.placeholder_ranges(tokenizer.encode(expanded, add_special_tokens=False).ids, [image])


def test_smart_resize():
    # Already fitting: nearest multiples of 28 (Python rounds halves to even: 70 / 28 = 2.5 -> 2).
    assert smart_resize(70, 140, 28, 56 * 56, 28 * 28 * 1280) == (56, 140)
    assert smart_resize(200, 300, 28, 3136, 31360) == (140, 196)  # scaled down into max_pixels
    assert smart_resize(20, 30, 28, 3136, 31360) == (56, 84)  # scaled up to min_pixels
    h, w = smart_resize(4000, 3000, 28, 3136, 28 * 28 * 1280)
    assert h % 28 == w % 28 == 0 and h * w <= 28 * 28 * 1280
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, 3136, 31360)


def test_extreme_aspect_ratio_is_a_bad_request():
    """Qwen's resize refuses it (Gemma 3 resizes every image to one square)."""
    with pytest.raises(InvalidParameter, match="aspect ratio"):
        image_processor(VLM / "qwen2_5_vl").preprocess(Image.new("RGB", (2500, 10)), field="messages[0].content[0]")
