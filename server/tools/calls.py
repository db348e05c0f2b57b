"""Tool calls in chat replies: the constraint a `tool_choice` imposes, and how a reply becomes `tool_calls`.

1. `tool_choice` "required" and a named function are structured outputs (`tool_choice_spec`): a named
   function's reply is its arguments object, under the function's JSON Schema; "required" replies with a
   compact JSON array of `{"name": ..., "parameters": {...}}`, one item per call, each item under the
   schema of the function it names. The model cannot answer anything else.
2. "auto" leaves the reply free; the `--tool-call-parser` named at start-up (server/tools/parsers.py) finds
   the calls the model wrote in its own format.
3. `replier` gives one choice's reply handler for either: whole (`parse`) or streamed (`stream().feed`),
   where arguments go out as JSON text pieces whose concatenation is the call's `arguments`.
"""

from __future__ import annotations

import json

from jaxserve.sampling.grammar import StructuredOutputsParams
from server.tools.parsers import ParsedOutput, StreamDelta, ToolCall, ToolCallDelta, get_parser, new_call_id


def tool_choice_spec(body) -> StructuredOutputsParams | None:
    """The constraint of a chat request's tool_choice (None for "none" and "auto")."""
    if body.tool_mode == "named":
        schema = body.named_tool().parameters or {"type": "object"}
        return StructuredOutputsParams(json=schema, field="tools")
    if body.tool_mode == "required":
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": t.function.parameters or {"type": "object"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in body.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        # Compact (no optional whitespace), so a streamed reply can be cut into calls as it arrives.
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True, field="tools")
    return None


def replier(body, tool_parser: str | None):
    """The reply handler of one choice of `body` (None when its reply is plain text)."""
    mode = body.tool_mode
    if mode == "named":
        return NamedCall(body.named_tool().name)
    if mode == "required":
        return RequiredCalls()
    if mode == "auto" and body.tools and tool_parser:
        return get_parser(tool_parser)
    return None


class NamedCall:
    """The reply is the arguments of one call to the named function."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=None, tool_calls=[ToolCall(name=self.name, arguments=text, id=new_call_id())])

    def stream(self) -> NamedCall._Stream:
        return NamedCall._Stream(self.name)

    class _Stream:
        def __init__(self, name: str):
            self.name, self.called = name, False

        def feed(self, new_text: str) -> StreamDelta:
            delta = ToolCallDelta(index=0, arguments=new_text)
            if not self.called:
                delta.id, delta.name, self.called = new_call_id(), self.name, True
            return StreamDelta(tool_calls=[delta] if delta.name or new_text else [])

        def finish(self) -> StreamDelta:
            return self.feed("") if not self.called else StreamDelta()


class RequiredCalls:
    """The reply is `[{"name":"f","parameters":{...}},...]`, compact (see tool_choice_spec)."""

    def parse(self, text: str) -> ParsedOutput:
        calls = [ToolCall(name=name, arguments=arguments, id=new_call_id())
                 for name, arguments, done in _scan_calls(text) if done]
        return ParsedOutput(content=None, tool_calls=calls)

    def stream(self) -> RequiredCalls._Stream:
        return RequiredCalls._Stream()

    class _Stream:
        def __init__(self):
            self.text = ""
            self.sent: list[int] = []  # per announced call: characters of its arguments sent so far

        @property
        def called(self) -> bool:
            return bool(self.sent)

        def feed(self, new_text: str) -> StreamDelta:
            self.text += new_text  # the reply is short (call arguments): rescanning it whole is cheap
            deltas = []
            for index, (name, arguments, _) in enumerate(_scan_calls(self.text)):
                delta = ToolCallDelta(index=index)
                if index == len(self.sent):
                    delta.id, delta.name = new_call_id(), name
                    self.sent.append(0)
                delta.arguments = arguments[self.sent[index]:]
                self.sent[index] = len(arguments)
                if delta.name or delta.arguments:
                    deltas.append(delta)
            return StreamDelta(tool_calls=deltas)

        def finish(self) -> StreamDelta:
            return StreamDelta()


_CALL_HEAD = '{"name":"'
_ARGUMENTS_KEY = '","parameters":'


def _scan_calls(text: str) -> list[tuple[str, str, bool]]:
    """(name, the arguments text so far, whether it is complete) of each call of a required reply whose name
    is complete. The grammar fixes the layout, so positions are found, not parsed for."""
    calls, at = [], 1  # after the opening bracket
    while text.startswith(_CALL_HEAD, at):
        name_end = text.find('"', at + len(_CALL_HEAD))
        if name_end < 0 or not text.startswith(_ARGUMENTS_KEY, name_end):
            break
        name = json.loads(text[at + len(_CALL_HEAD) - 1:name_end + 1])
        start = name_end + len(_ARGUMENTS_KEY)
        end = _value_end(text, start)
        calls.append((name, text[start:end if end is not None else len(text)], end is not None))
        if end is None:
            break
        at = end + 2  # the item's closing brace, then a comma (or the closing bracket: the loop ends)
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `start` ends (exclusive), or None if it has not yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
