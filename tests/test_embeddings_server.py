"""`/v1/embeddings` end to end on a pooling server (the random Qwen3 embedding fixture): the official
`openai` client (float and base64), batched inputs of every shape, usage, OpenAI errors for bad input,
and the generation APIs refused by a pooling server."""

from __future__ import annotations

import asyncio
import base64
import re

import httpx
import numpy as np
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from tests.embedding_model import ENGINE_KWARGS, as_text, golden, golden_prompts, servable_copy
from tests.page_checks import assert_pages_released
from tests.server_harness import assert_error, running_server
from server.options import ServerOptions

TOLERANCE = 1e-4
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Served as a Matryoshka model (a config.json entry: the weights are the same), for `dimensions`.
    model = servable_copy(tmp_path_factory.mktemp("embed-server"), matryoshka_dimensions=[16, 32, 64])
    options = ServerOptions(chat_template=TEMPLATE)  # the fixture has no chat template of its own
    with running_server(EngineArgs(model=str(model), runner="pooling", **ENGINE_KWARGS),
                        options=options) as (base, async_engine):
        yield base, async_engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_openai_client_float_and_base64(client):
    g, prompts = golden(), golden_prompts()
    model = client.models.list().data[0].id
    texts = [as_text(p) for p in prompts]
    # Without encoding_format the client asks for base64 and decodes it itself; then floats explicitly.
    for fmt in (openai.NOT_GIVEN, "float"):
        out = client.embeddings.create(model=model, input=texts, encoding_format=fmt)
        assert [d.index for d in out.data] == [0, 1, 2, 3]
        np.testing.assert_allclose([d.embedding for d in out.data], g["last_token_normalized"], atol=TOLERANCE,
                                   rtol=0)
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, prompts))
        assert out.model == model and out.object == "list"
    one = client.embeddings.create(model=model, input=prompts[1])  # one list of token ids
    np.testing.assert_allclose(one.data[0].embedding, g["last_token_normalized"][1], atol=TOLERANCE, rtol=0)
    # Matryoshka: the first 32 dimensions, normalized again
    cut = client.embeddings.create(model=model, input=texts[2], dimensions=32).data[0].embedding
    expected = g["last_token"][2, :32] / np.linalg.norm(g["last_token"][2, :32])
    np.testing.assert_allclose(cut, expected, atol=TOLERANCE, rtol=0)


def test_raw_base64_token_id_batches_and_truncation(server):
    base, async_engine = server
    g, prompts = golden(), golden_prompts()
    r = httpx.post(f"{base}/v1/embeddings", json={"input": prompts, "encoding_format": "base64",
                                                  "normalize": False})
    assert r.status_code == 200, r.text
    body = r.json()
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]]
    np.testing.assert_allclose(got, g["last_token"], atol=TOLERANCE, rtol=0)
    assert body["id"].startswith("embd-") and body["usage"]["prompt_tokens"] == 78
    # truncate_prompt_tokens keeps the last tokens: 40 tokens cut to the last 11 of prompt 3
    long = prompts[3][:29] + prompts[1]
    r = httpx.post(f"{base}/v1/embeddings", json={"input": [long], "truncate_prompt_tokens": 11})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], g["last_token_normalized"][1], atol=TOLERANCE,
                               rtol=0)
    assert r.json()["usage"]["prompt_tokens"] == 11
    assert async_engine.engine.compilations_since_warmup == 0


def test_chat_style_messages_embed_the_rendered_conversation(server):
    base, _ = server
    g, prompts = golden(), golden_prompts()
    half = len(prompts[2]) // 2
    messages = [{"role": "system", "content": as_text(prompts[2][:half])},
                {"role": "user", "content": [{"type": "text", "text": as_text(prompts[2][half:])}]}]
    r = httpx.post(f"{base}/v1/embeddings", json={"messages": messages})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], g["last_token_normalized"][2], atol=TOLERANCE,
                               rtol=0)
    assert r.json()["usage"]["prompt_tokens"] == len(prompts[2])


def test_concurrent_requests_are_batched_and_equal_alone(server):
    base, async_engine = server
    g, prompts = golden(), golden_prompts()

    async def all_at_once():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(http.post(f"{base}/v1/embeddings", json={"input": prompts[i % 4]})
                                          for i in range(12)))

    stats = async_engine.engine.stats
    steps, seqs = stats.steps, stats.step_sequences
    answers = asyncio.run(all_at_once())
    for i, r in enumerate(answers):
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], g["last_token_normalized"][i % 4],
                                   atol=TOLERANCE, rtol=0)
    assert stats.step_sequences - seqs > stats.steps - steps  # requests shared steps
    assert_pages_released(async_engine.engine.scheduler)
    metrics = httpx.get(f"{base}/metrics").text
    done = re.search(r'vllm:request_success_total{[^}]*finished_reason="stop"[^}]*} ([0-9.]+)', metrics)
    assert done and float(done.group(1)) >= 12  # embeddings count as finished requests, as in vLLM


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": "t3 t4", "dimensions": 8}, 400, "dimensions", None),  # not one of the model's sizes
    ({"input": "t3 t4", "dimensions": 128}, 400, "dimensions", None),
    ({"input": []}, 400, "input", None),
    ({"input": ""}, 400, "input", None),
    ({"input": [[3, 4], []]}, 400, "input", None),
    ({}, 400, "input", "unsupported_parameter"),
    ({"input": [3] * 65}, 400, "input", "context_length_exceeded"),
    ({"input": [3, 999]}, 400, "input", None),
    ({"input": "t3", "encoding_format": "int8"}, 400, "encoding_format", None),
    ({"input": "t3", "messages": [{"role": "user", "content": "x"}]}, 400, "input", "unsupported_parameter"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": "t3"}], "chat_template": "{{ 1 }}"}, 400, "chat_template", None),
    ({"input": "t3", "model": "text-embedding-3-small"}, 404, "model", "model_not_found"),
])
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    base, async_engine = server
    err = assert_error(httpx.post(f"{base}/v1/embeddings", json=body), status)
    assert (err["param"], err["code"]) == (param, code)
    assert httpx.get(f"{base}/health").status_code == 200
    assert not async_engine.engine.has_unfinished()


def test_each_input_is_checked_once_before_any_is_queued(server, monkeypatch):
    """Every input is checked by the engine before any is queued, and queued as checked: once each."""
    base, async_engine = server
    engine = async_engine.engine
    checked, validate = [], engine.pooling.validate

    def counted(prompt_ids, params):
        checked.append(list(prompt_ids))
        return validate(prompt_ids, params)
    monkeypatch.setattr(engine.pooling, "validate", counted)
    assert httpx.post(f"{base}/v1/embeddings", json={"input": [[3, 4], [5, 6]]}).status_code == 200
    assert checked == [[3, 4], [5, 6]]
    checked.clear()
    assert_error(httpx.post(f"{base}/v1/embeddings", json={"input": [[3, 4], [3, 999]]}), 400, "input")
    assert checked == [[3, 4], [3, 999]] and not engine.has_unfinished()


def test_a_pooling_server_refuses_generation(server, client):
    base, _ = server
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.completions.create(model=client.models.list().data[0].id, prompt="t3 t4", max_tokens=2)
    for path, body in (("chat/completions", {"messages": [{"role": "user", "content": "t3"}]}),
                       ("responses", {"input": "t3"})):
        r = httpx.post(f"{base}/v1/{path}", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_api", r.text
    assert httpx.get(f"{base}/health").status_code == 200
