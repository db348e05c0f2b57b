"""`/v1/responses` with the official `openai` client, unchanged: text, streaming events in the documented
order, function tools (forced and parsed), `text.format`, `previous_response_id` and the store, and every
field either working or refused by name. The chat route runs each response, so where both can say the
same thing the tests check that they do."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from jaxserve.engine_args import EngineArgs
from server.options import ServerOptions
from server.responses.store import ResponseStore, StoredResponse
from tests.server_harness import SHARED_ENGINE, running_server
from tests.test_tool_calling import SCHEMAS, TEMPLATE, TIME, WEATHER

MODEL = "stories260K"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "get_time", "parameters": TIME}]
DOCUMENTED_TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server(stories_dir):
    args = EngineArgs(model=str(stories_dir), **SHARED_ENGINE)
    with running_server(args, options=ServerOptions(chat_template=TEMPLATE, tool_call_parser="hermes")) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


def chat(server, **body) -> dict:
    reply = httpx.post(f"{server[0]}/v1/chat/completions", json={"temperature": 0, **body}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def squash(types: list[str]) -> list[str]:
    """Event types with runs of the same delta event written once."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_text_response_is_the_chat_reply(client, server):
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Once upon a time",
                                       max_output_tokens=12, temperature=0)
    same = chat(server, max_tokens=12, messages=[{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Once upon a time"}])
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.output_text == same["choices"][0]["message"]["content"]
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].role == "assistant" and response.output[0].content[0].type == "output_text"
    assert response.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == 12 and response.usage.total_tokens == response.usage.input_tokens + 12
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == "Be brief." and response.max_output_tokens == 12 and response.temperature == 0


def test_streamed_events_follow_the_documented_order(client):
    body = dict(model=MODEL, input="Once upon a time", max_output_tokens=40, temperature=0, extra_body={"stop": ["park"]})
    whole = client.responses.create(**body)
    assert whole.status == "completed" and whole.completed_at and whole.incomplete_details is None
    events = list(client.responses.create(**body, stream=True))
    assert squash([e.type for e in events]) == DOCUMENTED_TEXT_EVENTS + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events[3:-2])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-2].item.content[0].text
    assert events[-1].response.output_text == text and events[-1].response.usage.output_tokens > 0


def test_required_function_call(client):
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                       max_output_tokens=120)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_named_function_call_streams_its_arguments(client):
    body = dict(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=80,
                tool_choice={"type": "function", "name": "get_weather"})
    events = list(client.responses.create(**body, stream=True))
    assert squash([e.type for e in events]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", events[-1].type]
    added, done = events[2].item, events[-2].item
    assert (added.type, added.name, added.arguments, added.status) == ("function_call", "get_weather", "", "in_progress")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == arguments == events[-3].arguments and done.call_id == added.call_id
    jsonschema.validate(json.loads(arguments), WEATHER)


def test_auto_tool_choice_parses_what_the_model_wrote(client):
    regex = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET|PST)"\}\}\n</tool_call>'
    response = client.responses.create(model=MODEL, input="Time?", tools=TOOLS, max_output_tokens=60,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output[0].name == "get_time" and json.loads(response.output[0].arguments)["zone"] in TIME[
        "properties"]["zone"]["enum"]


def test_function_call_output_follows_up_as_a_tool_message(client, server):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "UTC"}'}
    items = [{"role": "user", "content": "Time?"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    response = client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                       max_output_tokens=8, temperature=0)
    same = chat(server, max_tokens=8, tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                                             for t in TOOLS], tool_choice="none", messages=[
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "12:00"}])
    assert response.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert response.output_text == same["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_json_schema(client, stream):
    body = dict(model=MODEL, input="Weather?", max_output_tokens=60,
                text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    if stream:
        events = list(client.responses.create(**body, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert events[-1].response.text.format.type == "json_schema"
    else:
        text = client.responses.create(**body).output_text
    jsonschema.validate(json.loads(text), WEATHER)


def test_text_format_json_object(client):
    response = client.responses.create(model=MODEL, input="x", max_output_tokens=40,
                                       text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(response.output_text), dict)


def test_previous_response_id_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="Once upon a time", max_output_tokens=6, temperature=0)
    follow = client.responses.create(model=MODEL, input="Then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    same = chat(server, max_tokens=6, messages=[{"role": "user", "content": "Once upon a time"},
                                                {"role": "assistant", "content": first.output_text},
                                                {"role": "user", "content": "Then?"}])
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert follow.output_text == same["choices"][0]["message"]["content"]
    # Stored: it can be read back and deleted; then it is gone, as OpenAI answers.
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    missing = httpx.post(f"{server[0]}/v1/responses", json={"input": "x", "previous_response_id": first.id})
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": f"Previous response with id '{first.id}' not found.",
                                       "type": "invalid_request_error", "param": "previous_response_id",
                                       "code": "previous_response_not_found"}


def test_store_false_keeps_nothing(client):
    response = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="y", previous_response_id=response.id, max_output_tokens=2)


def test_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, StoredResponse({}, []))
    store.get("a")
    store.put("c", StoredResponse({}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    ResponseStore(0).put("a", StoredResponse({}, []))  # --responses-store-size 0: nothing kept


def test_fields_that_work(client, server):
    response = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Once"}]}], max_output_tokens=5,
        temperature=0.8, top_p=0.9, metadata={"k": "v"}, user="u1", safety_identifier="s1", prompt_cache_key="p",
        include=["message.output_text.logprobs"], top_logprobs=2, parallel_tool_calls=False, service_tier="auto",
        reasoning={"effort": "low"}, truncation="auto", extra_body={"seed": 7, "top_k": 20})
    assert (response.temperature, response.top_p, response.metadata, response.user) == (0.8, 0.9, {"k": "v"}, "u1")
    assert (response.safety_identifier, response.prompt_cache_key, response.top_logprobs) == ("s1", "p", 2)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 5 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == response.output_text
    again = client.responses.create(model=MODEL, input="Once", max_output_tokens=5, temperature=0.8, top_p=0.9,
                                    extra_body={"seed": 7, "top_k": 20})
    assert again.output_text == response.output_text  # the seed reached the sampler
    # top_k reached it too: keeping only the most likely token, sampling at temperature 0.8 is greedy.
    greedy = client.responses.create(model=MODEL, input="Once", max_output_tokens=12, temperature=0).output_text
    for seed in (1, 2, 3):
        top_1 = client.responses.create(model=MODEL, input="Once", max_output_tokens=12, temperature=0.8,
                                        extra_body={"seed": seed, "top_k": 1})
        assert top_1.output_text == greedy, (seed, top_1.output_text, greedy)


@pytest.mark.parametrize("field, value, param", [
    ("background", True, "background"),
    ("conversation", "conv_1", "conversation"),
    ("prompt", {"id": "pmpt_1"}, "prompt"),
    ("max_tool_calls", 3, "max_tool_calls"),
    ("tools", [{"type": "web_search"}], "tools"),
    ("tool_choice", {"type": "file_search"}, "tool_choice"),
    ("tool_choice", {"type": "function", "name": "nope"}, "tool_choice"),
    ("include", ["file_search_call.results"], "include"),
    ("top_logprobs", 2, "top_logprobs"),  # without include message.output_text.logprobs
    ("text", {"verbosity": "low"}, "text"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format"),
    ("reasoning", {"summary": "detailed"}, "reasoning"),
    ("service_tier", "flex", "service_tier"),
    ("prompt_cache_retention", "24h", "prompt_cache_retention"),
    ("stream_options", {"include_obfuscation": False}, "stream_options"),  # without stream
    ("input", [{"type": "computer_call_output", "call_id": "c", "output": {}}], "input.0.type"),
    ("input", [{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
    # stories260K reads text only: an image is refused by its field, before anything is fetched
    ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input.0.content.0.image_url.url"),
    ("input", [{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ("input", [], "input"),
    ("max_output_tokens", 100000, "max_output_tokens"),
    ("temperature", 3, "temperature"),
    ("top_k", -2, "top_k"),
])
def test_fields_refused_by_name(server, field, value, param):
    reply = httpx.post(f"{server[0]}/v1/responses", json={"input": "x", "max_output_tokens": 4, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_unknown_fields_are_ignored_with_a_warning(server, caplog):
    reply = httpx.post(f"{server[0]}/v1/responses", json={"input": "x", "max_output_tokens": 2, "frobnicate": 1,
                                                         "n": 3})
    assert reply.status_code == 200 and len(reply.json()["output"]) == 1  # n is chat's, not a Responses field
    assert any("ignored unknown fields ['frobnicate', 'n']" in r.getMessage() for r in caplog.records)


def test_wrong_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="x")
