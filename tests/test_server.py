"""The OpenAI-compatible server end to end: a real uvicorn on loopback, the official `openai` client,
concurrency, disconnects, errors, and the no-recompilation invariant."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from tests.page_checks import assert_pages_released
from server.options import ServerOptions
from tests.server_harness import SHARED_ENGINE, assert_error, running_server, scrape

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    # stories260K has no chat template of its own: the server's (--chat-template) stands in.
    with running_server(args, options=ServerOptions(chat_template=TEMPLATE)) as (base, async_engine):
        yield base, async_engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def test_openai_client_completions(client, story_text):
    model = client.models.list().data[0].id
    assert model == "stories260K"
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert story_text[len("Once upon a time"):].startswith(out.choices[0].text)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12

    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == out.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_openai_client_chat(client):
    kw = dict(model="stories260K", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=10,
              temperature=0)
    out = client.chat.completions.create(**kw)
    plain = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == plain.choices[0].text
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_multiple_prompts_in_one_completion_request(client):
    out = client.completions.create(model="stories260K", prompt=["The cat", "A bird"], max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(model="stories260K", prompt="A bird", max_tokens=6, temperature=0)
    assert out.choices[1].text == single.choices[0].text


@pytest.mark.parametrize("body, status, param, code", [
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", None),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "unsupported_parameter"),  # only with echo
    ({"prompt": "hi", "n": 0}, 400, "n", None),
    ({"prompt": []}, 400, "prompt", None),
    ({"max_tokens": 3}, 400, "prompt", None),
    ({"prompt": "hi", "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [1] + [403] * 520, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": [1, 99999]}, 400, "prompt", None),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", None),
])
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    base, async_engine = server
    err = assert_error(httpx.post(f"{base}/v1/completions", json=body), status)
    assert err["param"] == param and err["code"] == code
    assert httpx.get(f"{base}/health").status_code == 200
    assert not async_engine.engine.has_unfinished()


def test_each_prompt_is_checked_once_before_any_is_queued(server, monkeypatch):
    """The server has the engine check every prompt of a request before it queues any (a bad one queues
    nothing), and the engine queues what passed as it is: one check per prompt, not a second at submission."""
    base, async_engine = server
    engine = async_engine.engine
    checked, validate = [], engine.validate

    def counted(prompt_ids, *args, **kwargs):
        checked.append(list(prompt_ids))
        return validate(prompt_ids, *args, **kwargs)
    monkeypatch.setattr(engine, "validate", counted)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": [[1, 5], [1, 6]], "n": 2, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert checked == [[1, 5], [1, 6]]
    checked.clear()
    assert_error(httpx.post(f"{base}/v1/completions", json={"prompt": [[1, 5], [1, 99999]], "max_tokens": 2},
                            timeout=60), 400, "prompt")
    assert checked == [[1, 5], [1, 99999]] and not engine.has_unfinished()


def test_images_to_a_text_only_model_are_refused_by_name_before_fetching(server, client):
    """stories260K has no vision tower: an image part is a 400 naming it, whatever its URL (nothing is fetched:
    the private address would be refused otherwise), through chat completions and the Responses API."""
    for url in ("data:image/png;base64,iVBORw0KGgo=", "http://10.0.0.1/cat.png"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="stories260K", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Look: "}, {"type": "image_url", "image_url": {"url": url}}]}])
        assert e.value.body["param"] == "messages.0.content.1.image_url.url"
        assert "takes no images: it is a text-only model" in e.value.body["message"]
    r = httpx.post(f"{server[0]}/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://10.0.0.1/cat.png"}]}]})
    assert "takes no images" in assert_error(r, 400)["message"]
    assert httpx.get(f"{server[0]}/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    assert httpx.get(f"{server[0]}/health").status_code == 200


def test_malformed_json_and_a_request_chat_template(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # A request may not bring its own template (it would run on the server) unless the server trusts them.
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                        "chat_template": TEMPLATE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_a_generate_server_refuses_embeddings(server, client):
    base, _ = server
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client.embeddings.create(model="stories260K", input="Once upon a time")
    r = httpx.post(f"{base}/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_api"
    assert httpx.get(f"{base}/health").status_code == 200


async def _complete(base: str, body: dict) -> list[int]:
    """Token ids of one non-streaming request (decoded through the tokenizer-free `prompt` ids path)."""
    async with httpx.AsyncClient(timeout=300) as http:
        r = await http.post(f"{base}/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def test_batch_invariance_32_concurrent(server):
    base, _ = server
    rng = random.Random(0)
    words = ["Once upon a time", "The cat", "Lily saw a big", "Tom and his mom went", "One day, a bird",
             "The sun was hot and the"]
    bodies = []
    for i in range(32):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        body = {"prompt": prompt, "max_tokens": rng.randint(1, 40)}
        if i % 2:
            body |= {"temperature": rng.choice([0.5, 0.9, 1.3]), "top_p": rng.choice([0.8, 1.0]),
                     "top_k": rng.choice([0, 20]), "seed": rng.randint(0, 2**31)}
        else:
            body |= {"temperature": 0}
        bodies.append(body)

    async def together():
        return await asyncio.gather(*(_complete(base, b) for b in bodies))

    first = asyncio.run(together())
    alone = [asyncio.run(_complete(base, b)) for b in bodies[::2]]
    assert first[::2] == alone  # greedy: identical whether alone or among 32
    assert asyncio.run(together())[1::2] == first[1::2]  # seeded sampling: identical on a rerun


async def _stream_and_maybe_drop(http: httpx.AsyncClient, url: str, body: dict, drop_after: int | None) -> int:
    """Stream a request; with drop_after, close the connection after that many events. Returns events read."""
    seen = 0
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if drop_after is not None and seen >= drop_after:
                    break
    return seen


def test_disconnecting_stream_is_aborted_within_one_step(server):
    base, async_engine = server
    engine = async_engine.engine
    aborted_before = engine.stats.finished.get("abort", 0)

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            await _stream_and_maybe_drop(http, f"{base}/v1/completions",
                                         {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
                                          "ignore_eos": True, "stream": True}, drop_after=3)

    asyncio.run(go())
    for _ in range(200):
        if engine.stats.finished.get("abort", 0) > aborted_before and not engine.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.05))
    assert engine.stats.finished.get("abort", 0) == aborted_before + 1
    assert engine.abort_latencies[-1] <= 1  # freed at the first engine step after the abort
    assert_pages_released(engine.scheduler)  # the engine is idle: evicting from this thread is safe


def test_mixed_workload_never_recompiles_and_leaks_nothing(server):
    """200+ requests: prompt lengths 1..near the context limit, a third of them sharing system prompts
    (prefix-cache hits), random sampling, streaming or not, some clients vanishing mid-stream.
    Afterwards: zero compilations, every slot free, every page free or held only by the prefix cache."""
    base, async_engine = server
    engine = async_engine.engine
    limit = engine.scheduler_config.max_model_len
    rng = random.Random(1)
    # Shared prefixes that end mid-page and on a page boundary; hits start prefill at a later q_start.
    systems = [[1] + [rng.randint(3, 511) for _ in range(n - 1)] for n in (37, 160, 256)]
    before = scrape(base)

    def body(i):
        prompt_len = rng.choice([1, 2, rng.randint(3, 64), rng.randint(64, 300), rng.randint(300, limit - 40)])
        prompt = [1] + [rng.randint(3, 511) for _ in range(prompt_len - 1)]
        if i % 3 == 0:
            prompt = rng.choice(systems) + prompt[1:rng.randint(1, 100)]
            prompt_len = len(prompt)
        b = {"prompt": prompt,
             "max_tokens": rng.randint(1, min(32, limit - prompt_len)),
             "temperature": rng.choice([0, 0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
             "top_k": rng.choice([0, 0, 50]), "min_p": rng.choice([0.0, 0.05]),
             "seed": rng.choice([None, i]), "stream": rng.random() < 0.5}
        if rng.random() < 0.2:
            b["stop"] = ["."]
        return b

    bodies = [body(i) for i in range(210)]
    drops = [rng.randint(1, 4) if b["stream"] and rng.random() < 0.25 else None for b in bodies]

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            sem = asyncio.Semaphore(24)

            async def one(b, drop):
                async with sem:
                    if b["stream"]:
                        return await _stream_and_maybe_drop(http, f"{base}/v1/completions", b, drop)
                    r = await http.post(f"{base}/v1/completions", json=b)
                    assert r.status_code == 200, r.text
                    return 1

            await asyncio.gather(*(one(b, d) for b, d in zip(bodies, drops)))

    asyncio.run(run())
    for _ in range(200):  # dropped streams are aborted at the next engine step
        if not engine.has_unfinished():
            break
        asyncio.run(asyncio.sleep(0.05))
    metrics = scrape(base)
    assert metrics["jaxserve:compilations_total"] == 0
    assert metrics["jaxserve:num_requests_running"] == 0
    assert metrics["jaxserve:num_requests_waiting"] == 0
    assert metrics["jaxserve:kv_cache_usage_perc"] == 0  # idle cached pages count as free
    assert metrics["jaxserve:e2e_request_latency_seconds_count"] >= 210
    hits = metrics["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"]
    queries = metrics["jaxserve:prefix_cache_queries_total"] - before["jaxserve:prefix_cache_queries_total"]
    assert hits >= 60 * 32 and queries >= sum(len(b["prompt"]) for b in bodies) > hits
    assert "jaxserve:num_preemptions_total" in metrics
    steps = metrics["jaxserve:engine_steps_total"]
    assert 0 < steps < metrics["jaxserve:engine_step_sequences_total"] <= metrics["jaxserve:engine_step_tokens_total"]
    assert_pages_released(engine.scheduler)
    assert sum(d is not None for d in drops) > 10 and engine.stats.finished.get("abort", 0) > 0


def test_health_is_503_until_warm():
    from starlette.testclient import TestClient

    from jaxserve.entrypoints.async_engine import AsyncEngine
    from server.app import build_app

    with TestClient(build_app(AsyncEngine(EngineArgs()))) as http:  # never started: still "loading"
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        r = http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503


def test_prefix_cache_metrics_and_cache_salt(server):
    base, async_engine = server
    rng = random.Random(7)
    system = [1] + [rng.randint(3, 511) for _ in range(99)]  # 100 tokens: 6 full pages of 16

    def send(suffix, salt=None):
        body = {"prompt": system + suffix, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        before = scrape(base)
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        after = scrape(base)
        deltas = {k: after[f"jaxserve:prefix_cache_{k}_total"] - before[f"jaxserve:prefix_cache_{k}_total"]
                  for k in ("queries", "hits")}
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == deltas["hits"]
        return deltas

    assert send([5, 6], salt="a") == {"queries": 102, "hits": 0}
    assert send([7, 8], salt="a") == {"queries": 102, "hits": 96}
    assert send([7, 8], salt="b")["hits"] == 0  # another salt shares nothing
    assert send([9])["hits"] == 0  # nor does no salt
    assert send([9, 10])["hits"] == 96


def test_metrics_report_each_startup_phase(server):
    base, _ = server
    text = httpx.get(f"{base}/metrics").text
    phases = {}
    for line in text.splitlines():
        if line.startswith("jaxserve:startup_seconds{"):
            phases[line.split('phase="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    assert set(phases) == {"weights", "kv_cache", "compile", "total", "all_programs"}
    assert phases["total"] >= phases["weights"] + phases["compile"] and phases["compile"] > 0
    assert phases["all_programs"] >= phases["weights"] + phases["compile"]
    programs = {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("jaxserve:step_programs{")}
    assert programs["ready"] == programs["total"] > 1


def test_metrics_report_the_precision_and_bytes_of_weights_and_kv_cache(server):
    base, _ = server
    lines = httpx.get(f"{base}/metrics").text.splitlines()
    info = [line for line in lines if line.startswith("jaxserve:model_precision_info{")]
    assert any('part="weights"' in line and 'dtype="float32"' in line for line in info), info
    assert any('part="kv_cache"' in line and 'dtype="float32"' in line for line in info), info
    memory = {line.split('part="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in lines if line.startswith("jaxserve:model_memory_bytes{")}
    assert memory["weights"] > 0 and memory["kv_cache"] > 0
