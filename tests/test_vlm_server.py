"""Images in requests through the real server (uvicorn on loopback, the official `openai` client), serving the
tiny Gemma 3 vision checkpoint (tests/fixtures/vlm/gemma3; the engine serves its language model), and for one
test the tiny Qwen2.5-VL one (its own server: dynamic resolution, M-RoPE).

Every image is taken up to the engine's door (limits, loading under the media flags, the chat template's
placeholders, the processor's expansion), and each bad one is a 400 in OpenAI's shape naming the field: too
many images, an undecodable or truncated image, an unsupported scheme, file:// outside the allowed
directory, loopback / private / link-local hosts, a URL too large or too slow, a decompression bomb. A good
image ends in the plain refusal the server gives until the engine runs vision encoders. The server stays
healthy and answers text after all of them. (A text-only model's refusal: tests/test_server.py.)
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from jaxserve.engine_args import EngineArgs
from jaxserve.sampling.params import SamplingParams
from tests.server_harness import assert_error, running_server

VLM = Path(__file__).parent / "fixtures" / "vlm"
IMAGES = VLM / "images"
PNG = (IMAGES / "rgba.png").read_bytes()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": text}]}]


class _Images(http.server.BaseHTTPRequestHandler):
    """/big: a body past the byte limit; /slow: a few bytes, then silence past the fetch timeout."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path == "/big":
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
            self.wfile.write(b"\0" * (1 << 20))
        else:
            self.end_headers()
            self.wfile.write(PNG[:16])
            self.wfile.flush()
            time.sleep(3)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    (directory / "rgba.png").write_bytes(PNG)
    return directory


# One small step program (its compile is most of this file's time): the engine only answers text here.
SIZES = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,))


@pytest.fixture(scope="module")
def server(media_dir):
    args = EngineArgs(model=str(VLM / "gemma3"), **SIZES, allowed_local_media_path=str(media_dir), limit_mm_per_prompt='{"image": 2}',
                      media_fetch_timeout=1.0, max_media_bytes=200_000)
    with running_server(args) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def refused(client, messages) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="gemma3", messages=messages, max_tokens=4)
    assert e.value.status_code == 400
    return e.value.body


def _bomb() -> str:
    """56 million pixels in a 54 KB PNG: refused by its header, before decoding."""
    out = io.BytesIO()
    Image.new("L", (8000, 7000)).save(out, "PNG")
    return data_url(out.getvalue())


GOLDEN = dict(np.load(VLM / "gemma3" / "golden.npz"))
LANDSCAPE = data_url((IMAGES / "landscape.png").read_bytes())


def test_a_good_image_is_answered_as_transformers_does(server, client, media_dir):
    """The fixture's one-image and two-image conversations give its greedy tokens (the server's budget of 16
    tokens prefills them in chunks that stop before each image and take it whole)."""
    models = httpx.get(f"{server[0]}/v1/models").json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": LANDSCAPE}},
                                        {"type": "text", "text": " and "},
                                        {"type": "image_url", "image_url": {"url": (media_dir / "rgba.png").as_uri()}},
                                        {"type": "text", "text": ": compare."}]}]
    for case, messages in (("one_image", image_message(LANDSCAPE)), ("two_images", two)):
        reply = client.chat.completions.create(model="gemma3", messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        assert reply.model_extra["prompt_token_ids"] == GOLDEN[f"{case}.input_ids"].tolist()
        assert reply.choices[0].model_extra["token_ids"] == GOLDEN[f"{case}.greedy"].tolist(), case
    # The Responses API's input_image part takes the same path.
    r = httpx.post(f"{server[0]}/v1/responses", json={"model": "gemma3", "max_output_tokens": 4, "input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": LANDSCAPE},
                                     {"type": "input_text", "text": "What is this?"}]}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(GOLDEN["one_image.input_ids"])
    assert not server[1].engine.has_unfinished()


@pytest.mark.parametrize("urls, param, words", [
    ([data_url(PNG)] * 3, "messages.0.content.2.image_url.url", "at most 2 image"),
    ([data_url(b"this is not a picture")], "messages.0.content.0.image_url.url", "not an image that can be decoded"),
    ([data_url(PNG[:len(PNG) // 2])], "messages.0.content.0.image_url.url", "truncated or corrupt"),
    ([data_url(PNG, "text/html")], "messages.0.content.0.image_url.url", "not an image"),
    (["ftp://example.com/cat.png"], "messages.0.content.0.image_url.url", "unsupported image URL scheme"),
    (["gopher:cat"], "messages.0.content.0.image_url.url", "unsupported image URL scheme"),
    (["file:///etc/hostname"], "messages.0.content.0.image_url.url", "not a file under the allowed local media path"),
    (["http://127.0.0.1:9/cat.png"], "messages.0.content.0.image_url.url", "non-public address"),
    (["http://[::1]/cat.png"], "messages.0.content.0.image_url.url", "non-public address"),
    (["http://169.254.169.254/latest/meta-data"], "messages.0.content.0.image_url.url", "non-public address"),
    (["http://10.1.2.3/cat.png"], "messages.0.content.0.image_url.url", "non-public address"),
    ([data_url(b"\x89PNG" + b"A" * 300_000)], "messages.0.content.0.image_url.url", "larger than 200000 bytes"),
])
def test_bad_images_are_400s_naming_the_field(client, urls, param, words):
    error = refused(client, image_message(*urls))
    assert error["param"] == param and words in error["message"], error


def test_a_decompression_bomb_is_refused_by_its_header(client):
    error = refused(client, image_message(_bomb()))
    assert "more than the limit" in error["message"] and error["param"] == "messages.0.content.0.image_url.url"


def test_allowed_hosts_still_meet_the_byte_limit_and_the_timeout(server, client, image_host):
    """A host the operator allows (--allowed-media-domains) may be loopback; its images still stop at the
    byte limit (a declared 10 MiB) and the fetch timeout (a server that goes quiet)."""
    model = server.context.model
    inputs = model.image_inputs
    allowed = dataclasses.replace(inputs.policy, allowed_domains=("127.0.0.1",))
    model._image_inputs = dataclasses.replace(inputs, policy=allowed)
    try:
        error = refused(client, image_message(f"{image_host}/big"))
        assert "larger than 200000 bytes" in error["message"]
        started = time.monotonic()
        error = refused(client, image_message(f"{image_host}/slow"))
        assert "longer than 1s" in error["message"] and time.monotonic() - started < 2.5
        error = refused(client, image_message("http://localhost:9/cat.png"))
        assert "not one of the allowed media domains" in error["message"]
    finally:
        model._image_inputs = inputs


def test_the_server_stays_healthy_and_answers_text(server, client):
    for part in ({"type": "image_url"}, {"type": "image_url", "image_url": {"url": ""}}, {"type": "video_url"}):
        r = httpx.post(f"{server[0]}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
        assert assert_error(r, 400)["param"].startswith("messages.0.content.0"), r.text
    r = httpx.post(f"{server[0]}/tokenize", json={"messages": image_message(data_url(PNG))})
    assert "this route takes text only" in assert_error(r, 400, "messages.0.content.0.image_url.url")["message"]
    assert httpx.get(f"{server[0]}/health").status_code == 200
    reply = client.chat.completions.create(model="gemma3", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Say something short."}]}], max_tokens=4,
        temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    async_engine = server[1]
    assert not async_engine.engine.has_unfinished()


def test_offline_chat_and_multi_modal_data_take_the_same_path(server):
    """`LLM.chat` with image parts and `LLM.generate` with vLLM's multi_modal_data (PIL images) give the
    fixture's greedy tokens; a prompt without the model's placeholder per image, and too many images, are
    refused by name. (The same sizes as the server's engine: its step program comes from the run's
    compilation cache.)"""
    from jaxserve import LLM
    llm = LLM(str(VLM / "gemma3"), **SIZES, limit_mm_per_prompt={"image": 1})
    picture = Image.open(IMAGES / "landscape.png")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = GOLDEN["one_image.greedy"].tolist()
    for part in ({"type": "image_url", "image_url": {"url": LANDSCAPE}}, {"type": "image", "image": picture}):
        out = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}], greedy)
        assert out[0].outputs[0].token_ids == expected
    prompt = str(GOLDEN["one_image.prompt"])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": picture}}, greedy)
    assert out[0].prompt_token_ids == GOLDEN["one_image.input_ids"].tolist()
    assert out[0].outputs[0].token_ids == expected
    with pytest.raises(ValueError, match=r"at most 1 image\(s\)"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [picture, picture]}})
    with pytest.raises(ValueError, match="0 image placeholders .* for 1 images"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": picture}})
    assert llm.generate("<bos>Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished() and llm.engine.images.cache.num_referenced == 0


@pytest.fixture(scope="module")
def qwen_server():
    with running_server(EngineArgs(model=str(VLM / "qwen2_5_vl"), **{**SIZES, "max_model_len": 256})) as running:
        yield running


def test_a_qwen_image_is_answered_as_transformers_does(qwen_server):
    """Qwen2.5-VL through the openai client: the landscape's 35 image tokens are prefilled in chunks of 16 that
    cut through it (its image tokens attend causally), every token at its M-RoPE positions: the fixture's
    prompt ids and greedy tokens."""
    golden = dict(np.load(VLM / "qwen2_5_vl" / "golden.npz"))
    models = httpx.get(f"{qwen_server[0]}/v1/models").json()["data"]
    assert models[0]["input_modalities"] == ["text", "image"]
    client = openai.OpenAI(base_url=f"{qwen_server[0]}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=models[0]["id"], messages=image_message(LANDSCAPE), max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == golden["one_image.input_ids"].tolist()
    assert reply.choices[0].model_extra["token_ids"] == golden["one_image.greedy"].tolist()
    assert not qwen_server[1].engine.has_unfinished()
