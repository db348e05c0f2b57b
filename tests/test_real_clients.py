"""What client libraries people use against vLLM meet here, on one stories260K server with a chat template.

1. `instructor` in its JSON_SCHEMA, JSON and TOOLS modes extracts a small nested pydantic model (an enum,
   bounded integers and strings, a list of one or two sub-objects) on every seed, first try: stories260K
   knows children's stories and nothing of JSON, so every field it gets right is the grammar mask's doing,
   and it can only succeed because schemas are strict by default (no invented keys) and a grammar that
   ends reports finish_reason "stop", not "length" (which instructor reads as a cut answer).
2. The issue's reproductions over plain HTTP: a pydantic schema without `additionalProperties` gives
   exactly its keys; a budget too small to finish the grammar says "length".
3. Request heads over --max-header-bytes (100 KB, 1 MB, 8 MB on real sockets) get 431 or a closed
   connection, without the server holding them in memory, and the server serves on.
4. vLLM's model card fields, and --enable-request-id-headers (X-Request-Id as the response's id).
"""

from __future__ import annotations

import enum
import json
import socket
import threading
import time

import httpx
import instructor
import openai
import pytest
from pydantic import BaseModel, Field

from jaxserve.engine_args import EngineArgs
from jaxserve.sampling.grammar import StructuredOutputsParams
from server.options import DEFAULT_MAX_HEADER_BYTES, ServerOptions
from server.openai.protocol import ChatCompletionRequest
from server.tools.calls import tool_choice_spec
from tests.memory_probe import memory
from tests.server_harness import SHARED_ENGINE, running_server

# System messages are left out: instructor's JSON mode writes the whole schema into one, about 1,200 tokens
# of this tokenizer, more than twice stories260K's 512-token context (the schema reaches the server in the
# request itself instead, see test_instructor_extracts_a_nested_model).
TEMPLATE = "{% for m in messages if m['role'] != 'system' %}{{ m['content'] }}\n{% endfor %}"
PROMPT = [{"role": "user", "content": "Lily has a little dog named Max. Max is three and has a red ball."}]


class Kind(str, enum.Enum):
    CAT = "cat"
    DOG = "dog"
    BIRD = "bird"


class Toy(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    count: int = Field(ge=1, le=5)


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    kind: Kind
    age: int = Field(ge=0, le=30)
    toys: list[Toy] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    options = ServerOptions(chat_template=TEMPLATE, enable_request_id_headers=True)
    with running_server(args, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(f"{server[0]}/v1/models").json()["data"][0]["id"]


def _same_keys(data: dict, model: type[BaseModel]) -> None:
    """Exactly the model's fields, at every level: nothing invented beside them."""
    assert set(data) == set(model.model_fields), data
    for toy in data.get("toys", []):
        _same_keys(toy, Toy)


# ---- 1. instructor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "JSON", "TOOLS"])
@pytest.mark.parametrize("seed", range(5))
def test_instructor_extracts_a_nested_model(server, model_name, mode, seed):
    client = instructor.from_openai(openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    extra = {}
    if mode == "JSON":
        # JSON mode asks for `json_object` and puts the schema in a system message for the model to read; a
        # model this small cannot read it, so the schema also rides in the response_format, in llama.cpp's
        # spelling (`{"type": "json_object", "schema": ...}`), which this server honours.
        extra["extra_body"] = {"response_format": {"type": "json_object", "schema": Pet.model_json_schema()}}
    pet, completion = client.chat.completions.create_with_completion(
        model=model_name, response_model=Pet, messages=PROMPT, max_tokens=200, temperature=1.0, seed=seed,
        max_retries=0, **extra)  # max_retries=0: one attempt, so every seed must succeed first time
    assert isinstance(pet, Pet) and 1 <= len(pet.toys) <= 2
    choice = completion.choices[0]
    if mode == "TOOLS":
        assert choice.finish_reason == "tool_calls"
        raw = choice.message.tool_calls[0].function.arguments
    else:
        assert choice.finish_reason == "stop"
        raw = choice.message.content
    _same_keys(json.loads(raw), Pet)


# ---- 2. strict schemas and finish_reason over HTTP -----------------------------------------------------------

# The model: pydantic writes no additionalProperties.
ANIMAL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["cat", "dog", "bird"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30}}, "required": ["name", "kind", "age"]}


@pytest.mark.parametrize("max_tokens", [60, 200])
def test_a_schema_without_additional_properties_gives_exactly_its_keys_and_stops(server, max_tokens):
    for seed in range(3):
        r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=120, json={
            "messages": PROMPT, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "Animal", "schema": ANIMAL}}})
        choice = r.json()["choices"][0]
        assert set(json.loads(choice["message"]["content"])) == {"name", "kind", "age"}
        assert choice["finish_reason"] == "stop", choice
        assert r.json()["usage"]["completion_tokens"] <= max_tokens


def test_explicit_additional_properties_loosen_the_schema(server):
    """`additionalProperties: true` keeps JSON Schema's own meaning: the grammar lets keys beyond the listed
    ones through (checked on the compiled grammar: whether a sampled model writes one is chance)."""
    grammars = server[1].engine.grammars
    listed = '{"name":"Max","kind":"dog","age":3}'
    extra = '{"name":"Max","kind":"dog","age":3,"toy":"ball"}'
    assert _accepts(grammars, StructuredOutputsParams(json=ANIMAL), listed)
    assert not _accepts(grammars, StructuredOutputsParams(json=ANIMAL), extra)
    assert _accepts(grammars, StructuredOutputsParams(json={**ANIMAL, "additionalProperties": True}), extra)


def test_tool_parameters_are_strict_too(server):
    tools = [{"type": "function", "function": {"name": "adopt", "parameters": ANIMAL}}]
    grammars = server[1].engine.grammars
    for choice, listed, extra in [
            ("required", '[{"name":"adopt","parameters":{"name":"Max","kind":"dog","age":3}}]',
             '[{"name":"adopt","parameters":{"name":"Max","kind":"dog","age":3,"toy":"ball"}}]'),
            ({"type": "function", "function": {"name": "adopt"}}, '{"name":"Max","kind":"dog","age":3}',
             '{"name":"Max","kind":"dog","age":3,"toy":"ball"}')]:
        spec = tool_choice_spec(ChatCompletionRequest.model_validate(
            {"messages": PROMPT, "tools": tools, "tool_choice": choice}))
        assert _accepts(grammars, spec, listed) and not _accepts(grammars, spec, extra)


def _accepts(grammars, spec: StructuredOutputsParams, text: str) -> bool:
    """Whether the grammar compiled from `spec` takes `text` whole (in llguidance's own tokenization)."""
    matcher = grammars.matcher(spec)
    return all(matcher.consume(t) for t in grammars._ll().tokenize_str(text)) and matcher.done


def test_max_tokens_too_small_to_finish_the_grammar_says_length(server):
    r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=60, json={
        "messages": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "Animal", "schema": ANIMAL}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 5


# ---- 3. request head limit -------------------------------------------------------------------------------

def _head(extra_header_bytes: int) -> bytes:
    return (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * extra_header_bytes + b"\r\n\r\n")


def _send_raw(base: str, payload: bytes) -> bytes:
    """Send `payload` on a fresh connection; what the server answered (b"" if it only closed)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):  # closed while we were still sending: allowed
            pass
        try:
            return s.recv(65536)
        except ConnectionResetError:
            return b""


def test_a_head_just_over_the_limit_is_a_431_in_openai_shape(server):
    reply = _send_raw(server[0], _head(DEFAULT_MAX_HEADER_BYTES + 1000))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply[:200]
    error = json.loads(body)["error"]
    assert error["code"] == "request_header_fields_too_large" and str(DEFAULT_MAX_HEADER_BYTES) in error["message"]


def test_heads_within_the_limit_are_served_on_one_connection(server):
    with httpx.Client(base_url=server[0], timeout=30) as client:  # keep-alive: one connection, three requests
        for size in (100, 20_000, 30_000):
            assert client.get("/v1/models", headers={"X-Big": "a" * size}).status_code == 200


def test_huge_heads_are_refused_without_being_held_and_the_server_serves_on(server):
    payloads = [_head(n) for n in (100_000, 1_000_000, 8_000_000)]  # built before the baseline is taken
    baseline = memory()[0]
    peak, done = [baseline], threading.Event()

    def sample():  # the server runs in this process: its anonymous memory is ours
        while not done.is_set():
            peak[0] = max(peak[0], memory()[0])
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for payload in payloads:
            for _ in range(3):
                reply = _send_raw(server[0], payload)
                assert reply == b"" or reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    finally:
        done.set()
        sampler.join()
    # Held whole, the 8 MB head alone would add 8 MB or more (the parser copies it as it grows).
    assert peak[0] - baseline < 4 << 20, f"anonymous memory grew {(peak[0] - baseline) >> 10} KiB"
    assert httpx.get(f"{server[0]}/health", timeout=10).status_code == 200
    r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


# ---- 4. model card and request ids ------------------------------------------------------------------------

def test_the_model_card_has_vllms_fields(server, stories_dir):
    card = httpx.get(f"{server[0]}/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["root"] == str(stories_dir) and card["parent"] is None
    assert card["max_model_len"] == 512
    [permission] = card["permission"]
    assert permission["object"] == "model_permission" and permission["id"].startswith("modelperm-")
    assert permission["allow_sampling"] is True and permission["organization"] == "*"
    assert permission["group"] is None and permission["is_blocking"] is False


def test_x_request_id_becomes_the_response_id(server, monkeypatch):
    base, async_engine = server
    engine_ids = []
    generate = async_engine.generate
    monkeypatch.setattr(async_engine, "generate", lambda request, request_id, *rest: (
        engine_ids.append(request_id), generate(request, request_id, *rest))[1])
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4},
                   headers={"X-Request-Id": "job-42/a"}, timeout=60)
    assert r.json()["id"] == "cmpl-job-42/a" and r.headers["x-request-id"] == "job-42/a"
    # The header wins over the body's request_id, as in vLLM; streamed chunks carry it too.
    with httpx.stream("POST", f"{base}/v1/chat/completions", headers={"X-Request-Id": "job-43"}, timeout=60,
                      json={"messages": PROMPT, "max_tokens": 8, "stream": True, "request_id": "other"}) as stream:
        ids = {json.loads(line[6:])["id"] for line in stream.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-job-43"}
    # Two requests with one id run side by side: the engine's ids start with it and differ after it.
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(httpx.post(
        f"{base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16}, timeout=60,
        headers={"X-Request-Id": "same"}))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [(r.status_code, r.json()["id"]) for r in replies] == [(200, "cmpl-same")] * 2
    assert engine_ids[0].startswith("cmpl-job-42/a-") and engine_ids[1].startswith("chatcmpl-job-43-")
    assert all(i.startswith("cmpl-same-") for i in engine_ids[2:]) and len(set(engine_ids[2:])) == 2


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "tab\there", "é"])
def test_an_unusable_request_id_is_a_400(server, bad):
    r = httpx.post(f"{server[0]}/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                   headers={"X-Request-Id": bad.encode("utf-8")})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request_id"
    assert httpx.get(f"{server[0]}/health").status_code == 200
