"""server/tools/parsers.py: tool calls out of model text, whole and streamed in every chunking."""

from __future__ import annotations

import json
import random

import pytest

from server.tools.parsers import PARSERS, HermesToolParser, ToolCall, get_parser

NESTED_ARGS = ('{"query": {"filters": [{"field": "title", "op": "contains", "value": "a } b { c"}, [], {}],'
               ' "note": "she said \\"hi\\" {not json}", "path": "C:\\\\tmp\\\\x", "n": -1.5e3,'
               ' "flags": [true, false, null], "empty": ""}}')
UNICODE_ARGS = '{"city": "Zürich", "greeting": "こんにちは 🌍", "escaped": "\\u00fc\\n\\t"}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'
TIME_ARGS = '{"timezone": "Europe/Paris"}'


def chunkings(text: str):
    for size in (1, 2, 3, 7):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def stream_all(parser, pieces):
    """Feeds pieces; returns (content, calls as {index: [id, name, arguments]}, called)."""
    stream = parser.stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = ""
    calls: dict[int, list] = {}
    for delta in deltas:
        content += delta.content
        for piece in delta.tool_calls:
            if piece.index not in calls:
                # The first delta of a call names it; later ones never do again.
                assert piece.id and piece.id.startswith("call_") and len(piece.id) == 29
                assert piece.name
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert piece.id is None and piece.name is None
            calls[piece.index][2] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, calls, stream.called


def check(parser_name: str, text: str, content: str | None, calls: list[tuple[str, str]]):
    """parse() gives `content` and `calls` (name, arguments); streaming agrees in every chunking."""
    parser = get_parser(parser_name)
    parsed = parser.parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    for call in parsed.tool_calls:
        assert isinstance(call, ToolCall) and call.id.startswith("call_") and len(call.id) == 29
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in parsed.tool_calls}) == len(calls)
    for pieces in chunkings(text):
        streamed_content, streamed_calls, called = stream_all(parser, pieces)
        assert streamed_content == (content or ""), pieces
        assert [(name, args) for _, name, args in streamed_calls.values()] == calls, pieces
        assert called == bool(calls)


def hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


# hermes / qwen -------------------------------------------------------------------------------------------

def test_hermes_single_call():
    check("hermes", hermes("get_weather", WEATHER_ARGS), None, [("get_weather", WEATHER_ARGS)])


def test_hermes_two_calls():
    text = hermes("get_weather", WEATHER_ARGS) + "\n" + hermes("get_time", TIME_ARGS)
    check("hermes", text, None, [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])


def test_hermes_content_before_and_between_calls():
    text = ("Let me check.\n\n" + hermes("get_weather", WEATHER_ARGS)
            + "\nAnd the time:\n" + hermes("get_time", TIME_ARGS))
    check("hermes", text, "Let me check.\n\n\nAnd the time:", [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)])


def test_hermes_plain_text():
    for text in ["Hello there! How can I help?", "  if a < b and c > d: {x: 1} <b>bold</b> <tool_ end\n",
                 "Use the <tool_call> tag to call tools.", "a</tool_call>b", ""]:
        check("hermes", text, text.strip(), [])


def test_hermes_malformed_json_is_content():
    for text in ['<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',  # trailing comma
                 '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # string arguments
                 '<tool_call>\n{"name": "f", "arguments": {"a": NaN}}\n</tool_call>',
                 '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',  # no name
                 '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "f", "arguments": {"a": "line\nbreak"}}\n</tool_call>',  # raw control char
                 '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2}}\n</tool_call>',
                 '<tool_call>\nget_weather(city="Paris")\n</tool_call>',
                 '<tool_call>\n{"name": "f", "arguments": {"a": 1}',  # never closes
                 "<tool_call>"]:
        parsed = get_parser("hermes").parse(text)
        assert parsed.content == text.strip() and parsed.tool_calls == []


def test_hermes_malformed_then_valid():
    bad = '<tool_call>\n{"name": "f", "arguments": 7}\n</tool_call>'
    text = "Hi " + bad + hermes("get_time", TIME_ARGS)
    check("hermes", text, "Hi " + bad, [("get_time", TIME_ARGS)])


def test_hermes_unicode_and_nested_arguments():
    check("hermes", hermes("search", UNICODE_ARGS), None, [("search", UNICODE_ARGS)])
    check("hermes", "Searching…\n" + hermes("search", NESTED_ARGS), "Searching…", [("search", NESTED_ARGS)])


def test_hermes_arguments_kept_exactly_as_written():
    args = '{ "b" :2,\n  "a":[ 1 ,2 ] }'
    check("hermes", f'<tool_call>{{"arguments": {args}, "name": "f", "id": 1}}</tool_call>', None, [("f", args)])


def test_hermes_missing_arguments_and_missing_closing_tag():
    check("hermes", '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")])
    check("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_', None, [("f", "{}")])
    check("hermes", '<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g", "arguments": {}}', None,
          [("f", "{}"), ("g", "{}")])
    check("hermes", '<tool_call>{"name": "f", "arguments": {}}\nDone.', "Done.", [("f", "{}")])


def test_qwen_is_hermes():
    assert PARSERS["qwen"] is PARSERS["hermes"] is HermesToolParser
    check("qwen", "Sure.\n" + hermes("get_weather", WEATHER_ARGS), "Sure.", [("get_weather", WEATHER_ARGS)])


def test_hermes_streams_early_and_holds_markers_back():
    stream = get_parser("hermes").stream()
    assert stream.feed("Let me look <tool_").content == "Let me look"
    delta = stream.feed('call>\n{"name": "get_weather", "argu')
    assert delta.content == "" and delta.tool_calls == []  # the name is known, but not yet that it is a call
    delta = stream.feed('ments": {"city": "Pa')
    [first] = delta.tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"city": "Pa')
    assert stream.called
    delta = stream.feed('ris"}}\n</tool_call>')
    assert [d.arguments for d in delta.tool_calls] == ['ris"}']
    assert stream.finish().tool_calls == []


def test_hermes_stream_breaking_after_announcement_stays_a_call():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call> after'
    assert get_parser("hermes").parse(text).content == text
    content, calls, called = stream_all(get_parser("hermes"), [text[:40], text[40:]])
    assert called and calls[0][1] == "f" and calls[0][2] == '{"a": tru'
    assert content == "}}\n</tool_call> after"  # reading resumed where the JSON broke


def test_hermes_stream_finish_flushes_unfinished_block():
    stream = get_parser("hermes").stream()
    assert stream.feed('Hi <tool_call>\n{"name": "get_').content == "Hi"
    assert stream.finish().content == ' <tool_call>\n{"name": "get_'
    assert not stream.called


# llama3_json ---------------------------------------------------------------------------------------------

def llama(name: str, args: str, key: str = "parameters") -> str:
    return f'{{"name": "{name}", "{key}": {args}}}'


def test_llama3_single_call():
    check("llama3_json", llama("get_weather", WEATHER_ARGS), None, [("get_weather", WEATHER_ARGS)])
    check("llama3_json", "<|python_tag|>" + llama("get_weather", WEATHER_ARGS, "arguments"), None,
          [("get_weather", WEATHER_ARGS)])
    check("llama3_json", "\n  " + llama("now", "{}"), None, [("now", "{}")])
    check("llama3_json", '{"name": "now"}', None, [("now", "{}")])


def test_llama3_two_calls():
    calls = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    check("llama3_json", "; ".join(llama(*c) for c in calls), None, calls)
    check("llama3_json", "<|python_tag|>" + ";".join(llama(*c) for c in calls) + ";", None, calls)
    check("llama3_json", "\n".join(llama(*c) for c in calls), None, calls)


def test_llama3_content_after_calls():
    check("llama3_json", llama("get_time", TIME_ARGS) + "\nI'll check that for you.", "I'll check that for you.",
          [("get_time", TIME_ARGS)])


def test_llama3_content_before_a_call_is_all_content():
    text = "Sure! " + llama("get_weather", WEATHER_ARGS)
    check("llama3_json", text, text, [])


def test_llama3_plain_text():
    for text in ["The answer is 42.", "Use {braces} and <tags> freely.", "{this is not json}",
                 '{"answer": 42, "name_of_thing": "x"}',  # valid JSON, but no name: not a call
                 '{"nam": "a", "parameters": {}} is not how a call looks',
                 "<|python_tag|>brave_search.call(query=\"weather\")", "<b>", "{", "  "]:
        check("llama3_json", text, text.strip(), [])


def test_llama3_malformed_json_is_content():
    for text in ['{"name": "f", "parameters": {"a": 1,}}', '{"name": "f", "parameters": ["a"]}',
                 '{"name": "f", "parameters": {"a": 1}', '{"name": "f" "parameters": {}}', '{"name": "f",}']:
        parsed = get_parser("llama3_json").parse(text)
        assert parsed.content == text and parsed.tool_calls == []
    # A valid call followed by a stray brace: the call stands, the brace is content.
    check("llama3_json", '{"name": "f", "parameters": {"a": 1}}}', "}", [("f", '{"a": 1}')])
    # Broken before it could be announced: streaming agrees.
    check("llama3_json", '{"name": "f", "parameters": ["a"]} x', '{"name": "f", "parameters": ["a"]} x', [])


def test_llama3_unicode_and_nested_arguments():
    check("llama3_json", llama("search", UNICODE_ARGS), None, [("search", UNICODE_ARGS)])
    check("llama3_json", llama("search", NESTED_ARGS, "arguments"), None, [("search", NESTED_ARGS)])


def test_llama3_holds_leading_brace_until_decided():
    stream = get_parser("llama3_json").stream()
    assert stream.feed(" {").content == ""
    delta = stream.feed('"answer": 42')
    assert delta.content == "" and delta.tool_calls == []
    assert stream.feed("}").content == '{"answer": 42}'
    assert stream.feed(" ok").content == " ok"
    stream = get_parser("llama3_json").stream()
    assert stream.feed("{oops").content == "{oops"  # decided as soon as it cannot be JSON


# mistral -------------------------------------------------------------------------------------------------

def mistral(*calls: tuple[str, str]) -> str:
    return "[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def test_mistral_single_call():
    check("mistral", mistral(("get_weather", WEATHER_ARGS)), None, [("get_weather", WEATHER_ARGS)])
    check("mistral", '[TOOL_CALLS][{"arguments":{"a": 3.5, "b": 4}, "name": "add"}]', None,
          [("add", '{"a": 3.5, "b": 4}')])


def test_mistral_two_calls():
    calls = [("get_weather", WEATHER_ARGS), ("get_time", TIME_ARGS)]
    check("mistral", mistral(*calls), None, calls)
    check("mistral", mistral(calls[0]) + mistral(calls[1]), None, calls)


def test_mistral_content_before_and_after():
    check("mistral", "Checking.\n" + mistral(("get_weather", WEATHER_ARGS)) + "\nextra", "Checking.\n\nextra",
          [("get_weather", WEATHER_ARGS)])


def test_mistral_v11_format():
    check("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None,
          [("get_weather", WEATHER_ARGS)])
    check("mistral", 'hi{hi[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', "hi{hi",
          [("add", '{"a": 3.5, "b": 4}'), ("multiply", '{"a": 3, "b": 6}')])
    check("mistral", "[TOOL_CALLS]bash[ARGS]" + NESTED_ARGS, None, [("bash", NESTED_ARGS)])


def test_mistral_plain_text():
    for text in ["Hello [world] and {braces} and [TOOL_ and [TOOL_CALL]", "[1, 2, 3]", "[", ""]:
        check("mistral", text, text.strip(), [])


def test_mistral_malformed_json_is_content():
    for text in ['[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}]', '[TOOL_CALLS] [{"name": "f", "arguments": {}',
                 '[TOOL_CALLS]f[ARGS]{"a": 1']:
        parsed = get_parser("mistral").parse(text)
        assert parsed.content == text and parsed.tool_calls == []
    # Broken before they could be announced: streaming agrees.
    for text in ["[TOOL_CALLS] not json at all", '[TOOL_CALLS] [{"name": "f", "arguments": [1]}]',
                 '[TOOL_CALLS] [{"name": "f"', "[TOOL_CALLS]", "[TOOL_CALLS]toolname_no_args", '[TOOL_CALLS]f[ARGS]"x"',
                 "Hi [TOOL_CALLS] {}"]:
        check("mistral", text, text, [])
    # A broken second element: the first call stands, the rest is content.
    check("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": 1}]', ', {"name": 1}]', [("f", "{}")])


def test_mistral_unicode_and_nested_arguments():
    check("mistral", mistral(("search", UNICODE_ARGS), ("search", NESTED_ARGS)), None,
          [("search", UNICODE_ARGS), ("search", NESTED_ARGS)])


# all -----------------------------------------------------------------------------------------------------

def test_get_parser():
    assert {"hermes", "qwen", "llama3_json", "mistral"} <= set(PARSERS)
    for name in PARSERS:
        assert isinstance(get_parser(name), PARSERS[name])
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        get_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_never_raises_on_noise(name):
    rng = random.Random(0)
    alphabet = ['{', '}', '[', ']', '"', '\\', ':', ',', ';', ' ', '\n', 'a', '1', '-', 'e', '.', 'true', 'null',
                '<tool_call>', '</tool_call>', '<|python_tag|>', '[TOOL_CALLS]', '[ARGS]', '"name"', '"arguments"',
                '"parameters"', '"f"', '\x01', 'é']
    parser = get_parser(name)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        parsed = parser.parse(text)
        for call in parsed.tool_calls:
            assert isinstance(json.loads(call.arguments), dict) and call.name
        content, calls, _ = stream_all(parser, [text[i:i + 3] for i in range(0, len(text), 3)])
        # Streaming only differs from parse() where a call broke after it was announced, which leaves it
        # an extra call.
        if len(calls) == len(parsed.tool_calls):
            assert [(n, a) for _, n, a in calls.values()] == [(c.name, c.arguments) for c in parsed.tool_calls]
            assert content == (parsed.content or "")
