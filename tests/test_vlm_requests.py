"""The request side of image input (jaxserve/multimodal/chat_parts.py, prompt.py) against what transformers'
processors produced for the tiny Gemma 3 and Qwen2.5-VL checkpoints (tests/fixtures/vlm): chat messages in
OpenAI's shape (`image_url` parts with data: URLs) render through the checkpoint's chat template and the
processor's expansion to the fixture's exact input ids, each image's pixels, hash and token span; the media
flags as vLLM spells them. No engine here (tests/test_vlm_server.py runs the server)."""

import base64
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxserve.engine_args import EngineArgs, parse_mm_limits
from jaxserve.errors import InvalidMedia, InvalidParameter
from jaxserve.multimodal.chat_parts import ImageSource, split_images
from jaxserve.multimodal.media import MediaPolicy, image_hash
from jaxserve.multimodal.prompt import ImageInputs, ImagesNotServed
from jaxserve.text.tokenizer import Tokenizer

VLM = Path(__file__).parent / "fixtures" / "vlm"
IMAGE_NAMES = ("landscape", "rgba", "portrait")


def data_url(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode((VLM / "images" / f"{name}.png").read_bytes()).decode()


def image_part(index: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(IMAGE_NAMES[index])}}


# The fixtures' conversations (tools/make_vlm_fixtures.py CASES) as an OpenAI client sends them.
CONVERSATIONS = {
    "one_image": [{"role": "user", "content": [image_part(0), {"type": "text", "text": "What is this?"}]}],
    "two_images": [{"role": "user", "content": [image_part(0), {"type": "text", "text": " and "}, image_part(1),
                                                {"type": "text", "text": ": compare."}]}],
    "second_turn": [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi! Show me."},
                    {"role": "user", "content": [{"type": "text", "text": "Here: "}, image_part(2)]}],
}


@pytest.fixture(scope="module", params=("gemma3", "qwen2_5_vl"))
def family(request):
    directory = VLM / request.param
    inputs = ImageInputs.for_model(str(directory), request.param, MediaPolicy(), limit=4)
    return directory, inputs, Tokenizer.from_pretrained(directory), dict(np.load(directory / "golden.npz"))


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_openai_image_parts_give_the_processors_tokens(family, case):
    directory, inputs, tokenizer, golden = family
    messages, sources = split_images(CONVERSATIONS[case])
    assert [s.field for s in sources][:1] == [{"one_image": "messages.0.content.0.image_url.url",
                                               "two_images": "messages.0.content.0.image_url.url",
                                               "second_turn": "messages.2.content.1.image_url.url"}[case]]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == str(golden[f"{case}.prompt"])
    images = inputs.load(sources)
    prompt = inputs.prompt(text, images, sources, lambda t: tokenizer.encode(t, add_special_tokens=False))
    assert prompt.token_ids == golden[f"{case}.input_ids"].tolist()
    marked = np.zeros(len(prompt.token_ids), np.int32)
    for image in prompt.images:
        assert set(prompt.token_ids[image.offset:image.offset + image.length]) == {prompt.image_token_id}
        marked[image.offset:image.offset + image.length] = 1
    assert marked.tolist() == golden[f"{case}.token_type_ids"].tolist()
    for image, index, source in zip(prompt.images, golden[f"{case}.images"], sources):
        np.testing.assert_allclose(image.pixel_values, golden[f"image{index}.pixel_values"], rtol=0, atol=1e-6)
        reference = Image.open(VLM / "images" / f"{IMAGE_NAMES[index]}.png")
        assert image.content_hash == image_hash(reference) and image.field == source.field
        if directory.name == "qwen2_5_vl":
            assert image.grid_thw == tuple(golden[f"image{index}.grid_thw"])


def test_the_same_picture_hashes_the_same_however_it_came(tmp_path):
    """The content hash (the encoder and prefix caches' key) is of the pixels: a data: PNG and a file:// BMP
    of one picture share it; another picture does not."""
    Image.open(VLM / "images" / "landscape.png").save(tmp_path / "landscape.bmp")
    inputs = ImageInputs.for_model(str(VLM / "gemma3"), "gemma3", MediaPolicy(allowed_local_path=tmp_path), 4)
    sent, read = inputs.load([ImageSource(data_url("landscape"), "a"),
                              ImageSource((tmp_path / "landscape.bmp").as_uri(), "b")])
    assert image_hash(sent) == image_hash(read) != image_hash(Image.open(VLM / "images" / "portrait.png"))


def test_part_shapes_and_fields():
    """image_url objects, the Responses API's input_image, the offline image / image_pil parts; text-only
    messages pass unchanged; an image part without its image is refused by name."""
    pil = Image.new("RGB", (4, 4))
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_image", "image_url": "u1"},
                                             {"type": "image", "image": pil}, {"type": "image_pil", "image_pil": pil}]}]
    rendered, sources = split_images(messages)
    assert rendered[0] is messages[0]
    assert rendered[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"},
                                      {"type": "image"}]
    assert [(s.source, s.field) for s in sources] == [("u1", "messages.1.content.1.image_url"),
                                                      (pil, "messages.1.content.2.image"),
                                                      (pil, "messages.1.content.3.image_pil")]
    with pytest.raises(InvalidMedia) as refused:
        split_images([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}])
    assert refused.value.param == "messages.0.content.0.image_url.url"


def test_limits_and_text_only_models_refuse_before_fetching(family, tmp_path):
    _, inputs, _, _ = family
    never = [ImageSource("http://10.0.0.1/never-fetched.png", f"messages.0.content.{j}.image_url.url")
             for j in range(5)]
    with pytest.raises(InvalidParameter, match="at most 4 image") as refused:
        inputs.check(never)
    assert refused.value.param == "messages.0.content.4.image_url.url"
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    text_only = ImageInputs.for_model(str(tmp_path), "tiny-llama", MediaPolicy(), limit=4)
    with pytest.raises(ImagesNotServed, match="`tiny-llama` takes no images") as refused:
        text_only.check(never[:1])
    assert refused.value.param == never[0].field
    assert not ImageInputs.for_model(None, "demo", MediaPolicy(), 4).takes_images  # the random demo model


def test_media_flags_as_vllm_spells_them(tmp_path):
    from jaxserve.entrypoints.args import engine_args_from
    from jaxserve.entrypoints.cli import build_parser
    ns = build_parser().parse_args(
        ["generate", "--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "images.example",
         "cdn.example", "--limit-mm-per-prompt", '{"image": 2, "video": 0}', "--media-fetch-timeout", "3",
         "--max-media-bytes", "1000", "--max-num-encoder-input-tokens", "512", "--mm-encoder-cache-gb", "0.5",
         "--prompt", "x"])
    args = engine_args_from(ns)
    assert args.allowed_local_media_path == str(tmp_path) and args.image_limit == 2
    assert args.max_num_encoder_input_tokens == 512 and args.mm_encoder_cache_gb == 0.5
    assert args.allowed_media_domains == ("images.example", "cdn.example")
    inputs = ImageInputs.from_args(args, "m")
    assert inputs.policy.allowed_local_path == tmp_path.resolve() and inputs.policy.max_bytes == 1000
    assert inputs.policy.fetch_timeout_s == 3 and inputs.limit == 2
    assert EngineArgs().image_limit == 16
    assert parse_mm_limits({"image": {"count": 3, "width": 512}}) == {"image": 3}
    for bad, match in (('{"image": -1}', "count >= 0"), ("image=2", "not valid JSON"), ('{"picture": 1}', "modality"),
                       ("[1]", "JSON object")):
        with pytest.raises(ValueError, match=match):
            parse_mm_limits(bad)
    with pytest.raises(ValueError, match="not a directory"):
        EngineArgs(allowed_local_media_path=str(tmp_path / "missing"))
    for bad, match in (({"max_num_encoder_input_tokens": 0}, "positive number of image tokens"),
                       ({"mm_encoder_cache_gb": -1}, "GiB >= 0"), ({"mm_encoder_cache_gb": float("nan")}, "GiB >= 0")):
        with pytest.raises(ValueError, match=match):
            EngineArgs(**bad)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for flag in ("--allowed-local-media-path", "--allowed-media-domains", "--limit-mm-per-prompt",
                 "--media-fetch-timeout", "--max-media-bytes", "--max-num-encoder-input-tokens",
                 "--mm-encoder-cache-gb"):
        assert flag in readme, f"the README's Images paragraph does not name {flag}"
