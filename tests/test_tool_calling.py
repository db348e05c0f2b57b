"""Structured outputs and tool calling through the HTTP API, with the official `openai` client.

stories260K cannot write JSON or tool calls on its own: every call and every parsed object here comes from
the grammar mask (tool_choice "required" / a named function / response_format), or — for tool_choice
"auto" — from the server's tool-call parser reading what a regex made the model write.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from server.options import ServerOptions
from tests.server_harness import SHARED_ENGINE, running_server, scrape

# A chat template in the Hermes / Qwen style: tools in the system turn, calls and results in the history.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    options = ServerOptions(chat_template=TEMPLATE, tool_call_parser="hermes")
    with running_server(args, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def assert_valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[dict[int, dict], str]:
    """Assemble streamed tool-call deltas as a client would: {index: {id, name, arguments}}, finish reason."""
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "the id comes once"
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("seed", range(3))
def test_required_returns_calls_that_validate(client, seed):
    reply = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
    choice = reply.choices[0]
    # The model writes stories into any free string; near max_tokens the grammar is steered to its end, so
    # the reply is whole and ends for its calls ("length" would tell clients it was cut).
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert_valid_calls(choice.message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_function_is_called_with_valid_arguments(client, name):
    reply = client.chat.completions.create(
        model="stories260K", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": name}})
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == name
    assert_valid_calls(calls)
    # The grammar ends the reply (for get_weather's free string, steered to its end near max_tokens), which
    # ends for the call.
    assert reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_assemble_into_valid_calls(client, tool_choice):
    stream = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, seed=4,
                                            tool_choice=tool_choice, temperature=1.0, max_tokens=200, stream=True)
    calls, finish = streamed_calls(stream)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_streamed_and_whole_replies_agree(server):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 9,
            "max_tokens": 200}
    whole = httpx.post(f"{server[0]}/v1/chat/completions", json=body, timeout=60).json()
    client = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)
    calls, _ = streamed_calls(client.chat.completions.create(model="stories260K", stream=True, **body))
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["choices"][0]["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected


def test_auto_parses_calls_the_model_wrote(client):
    # The regex makes the model write a Hermes call; "auto" leaves the reply free, so the parser finds it.
    regex = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET|PST)"\}\}\n</tool_call>'
    reply = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           extra_body={"structured_outputs": {"regex": regex}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert_valid_calls(choice.message.tool_calls)
    plain = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, max_tokens=20,
                                           temperature=0)
    assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].message.content


def test_a_follow_up_turn_with_tool_results_renders(server, client):
    first = client.chat.completions.create(model="stories260K", messages=MESSAGES, tools=TOOLS, seed=2,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=1.0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    rendered = httpx.post(f"{server[0]}/tokenize", json={"messages": history, "return_token_strs": True},
                          timeout=30).json()
    text = "".join(rendered["token_strs"])
    # The arguments went back into the template as an object (rendered by tojson), the result as a tool turn.
    assert json.dumps(json.loads(call.function.arguments))[:10] in text.replace("\\u", "")
    assert "<tool>sunny, 21 C</tool>" in text
    reply = client.chat.completions.create(model="stories260K", messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=10)
    assert reply.choices[0].message.content


def test_json_schema_response_format_with_the_openai_client(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number"}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    for seed in range(5):
        reply = client.chat.completions.create(
            model="stories260K", messages=MESSAGES, seed=seed, temperature=1.0, max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),  # fine here (parser configured): checked in the next test
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
      {"a": {"type": "wrong"}}}}}], "tool_choice": "required"}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "unknown": 1}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "x" * 300_000}}, None),  # over the body limit or the spec limit
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    full = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **body}
    reply = httpx.post(f"{server[0]}/v1/chat/completions", json=full, timeout=30)
    if body.get("tool_choice") == "auto":
        assert reply.status_code == 200
        return
    assert reply.status_code in (400, 413), reply.text
    if param is not None:
        assert (reply.json()["error"]["param"] or "").startswith(param), reply.text


def test_auto_needs_a_parser(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)  # the sizes of this file's other server
    with running_server(args, options=ServerOptions(chat_template=TEMPLATE)) as (base, _):
        reply = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in reply.json()["error"]["message"]
        ok = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "seed": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]


def test_nothing_compiles_while_constrained_and_plain_requests_mix(server, client):
    before = scrape(server[0])["jaxserve:compilations_total"]
    from concurrent.futures import ThreadPoolExecutor

    def one(i):
        kinds = [dict(tools=TOOLS, tool_choice="required"), dict(response_format={"type": "json_object"}),
                 dict(), dict(extra_body={"guided_choice": ["a", "b"]}), dict(logprobs=True, top_logprobs=2)]
        return client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=150,
                                              temperature=1.0, seed=i, **kinds[i % len(kinds)])

    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(one, range(20)))
    assert all(r.choices[0].finish_reason in ("stop", "length", "tool_calls") for r in replies)
    assert scrape(server[0])["jaxserve:compilations_total"] == before
