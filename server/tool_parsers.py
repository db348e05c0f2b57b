"""Tool calls in a model's chat output, for `tool_choice: "auto"`, under vLLM's `--tool-call-parser` names.

1. `get_parser(name)` gives the parser of one format: `hermes` (Hermes 2 Pro; `qwen` is the same parser,
   since the Qwen2, 2.5 and 3 chat templates use the Hermes format), `llama3_json` (Llama 3.1-3.3) or
   `mistral`. `parse()` splits a whole output into plain content and OpenAI tool calls; `stream()` gives
   one choice's state for doing the same piece by piece.
2. A small state machine per format reads the text left to right: plain content until the format's
   marker, then one JSON object per call. A strict JSON scanner checks that object a character at a time
   and notes where its "name" and "arguments" members lie: the arguments are returned exactly as the
   model wrote them ("{}" when it gave none), and a stream knows where they end as soon as they do.
3. A candidate call that turns out malformed (invalid JSON, no name, arguments that are not an object,
   or an output that ends first) is plain content, marker and all, and reading resumes at the character
   that broke it. Nothing raises on model output.
4. Streaming runs the same machine on each new piece. Content goes out as soon as it cannot be the start
   of a marker. A call's first delta (index, id, whole name) goes out once the name is read and the
   arguments object has begun; then each delta carries the arguments text the scanner has passed.
5. `parse()` is that machine run over the whole text, except that a call is kept only once its object is
   complete. So streaming and `parse()` agree on the content and the calls, except for a call that breaks
   after its first delta went out: streamed, it stays started.
6. Content is the text outside the calls, trimmed at both ends: a stream holds whitespace back until
   something follows it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it
    id: str


@dataclasses.dataclass
class ParsedOutput:
    content: str | None  # None when empty and there are tool calls
    tool_calls: list[ToolCall]


@dataclasses.dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # id and name: only in the first delta of a call
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# ---------------------------------------------------------------------------------------------------------
# JSON, a character at a time

_WHITESPACE = " \t\n\r"  # JSON's, which is also what the formats allow around their markers
_NOT_WHITESPACE = re.compile(r"[^ \t\n\r]")
_PLAIN_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER_STARTS = frozenset("-0123456789")
_LITERALS = ("true", "false", "null")
_ESCAPABLE = frozenset('"\\/bfnrt')
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")

(_ROOT, _OBJECT_START, _KEY, _COLON, _VALUE, _ARRAY_START, _AFTER_VALUE,
 _STRING, _ESCAPE, _UNICODE_ESCAPE, _NUMBER_TOKEN, _LITERAL_TOKEN) = range(12)


class _JsonObject:
    """One JSON object read incrementally and checked strictly (no NaN, no raw control characters in
    strings: what any client's JSON parser accepts). Subclasses watch the root object's members."""

    def __init__(self) -> None:
        self.text = ""  # everything taken so far
        self.done = False
        self.failed = False
        self._state = _ROOT
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._string_is_key = False
        self._key: str | None = None  # the root member being read
        self._key_start = 0
        self._member_start = 0
        self._token_start = 0
        self._hex_left = 0

    def feed(self, chunk: str) -> int:
        """Takes `chunk` up to the object's end, or up to the first character that cannot continue a valid
        object (then `failed`). Returns how many characters were taken."""
        base = len(self.text)
        self.text += chunk  # the member hooks slice it; cut back below to what was taken
        i, n = 0, len(chunk)
        while i < n:
            if self._state == _STRING:
                run = _PLAIN_STRING_RUN.match(chunk, i)
                if run:  # long string values (code, prose) skip the per-character steps
                    i = run.end()
                    continue
            if not self._step(chunk[i], base + i):
                self.failed = True
                break
            i += 1
            if self.done:
                break
        self.text = self.text[:base + i]
        return i

    # Hooks, each returning False to reject the character at hand.
    def _member_started(self, key: str | None, start: int, first: str) -> bool:
        return True

    def _member_ended(self, key: str | None, start: int, end: int) -> bool:
        return True

    def _object_closed(self, end: int) -> bool:
        return True

    def _step(self, c: str, pos: int) -> bool:
        state = self._state
        if state == _STRING:
            if c == '"':
                return self._string_closed(pos)
            if c == "\\":
                self._state = _ESCAPE
                return True
            return False  # a raw control character
        if state == _ESCAPE:
            if c == "u":
                self._state, self._hex_left = _UNICODE_ESCAPE, 4
                return True
            self._state = _STRING
            return c in _ESCAPABLE
        if state == _UNICODE_ESCAPE:
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _STRING
            return c in _HEX_DIGITS
        if state == _NUMBER_TOKEN:
            if c in _NUMBER_CHARS:
                return True
            # A number ends only at the next character, which is then read as what follows the value.
            if not _NUMBER.fullmatch(self.text, self._token_start, pos) or not self._value_ended(pos):
                return False
        elif state == _LITERAL_TOKEN:
            if "a" <= c <= "z":
                # Rejecting early lets a plain-text `{true story}` go to content without waiting.
                token = self.text[self._token_start:pos + 1]
                return any(literal.startswith(token) for literal in _LITERALS)
            if self.text[self._token_start:pos] not in _LITERALS or not self._value_ended(pos):
                return False
        state = self._state
        if state == _ROOT:
            if c != "{":
                return False
            self._stack.append(c)
            self._state = _OBJECT_START
            return True
        if c in _WHITESPACE:
            return True
        if state in (_OBJECT_START, _KEY):
            if c == '"':
                self._state, self._string_is_key, self._key_start = _STRING, True, pos
                return True
            return c == "}" and state == _OBJECT_START and self._container_closed(pos)
        if state == _COLON:
            self._state = _VALUE
            return c == ":"
        if state in (_VALUE, _ARRAY_START):
            if c == "]" and state == _ARRAY_START:
                return self._container_closed(pos)
            return self._value_started(c, pos)
        # _AFTER_VALUE
        in_object = self._stack[-1] == "{"
        if c == ",":
            self._state = _KEY if in_object else _VALUE
            return True
        return c == ("}" if in_object else "]") and self._container_closed(pos)

    def _value_started(self, c: str, pos: int) -> bool:
        if len(self._stack) == 1:
            self._member_start = pos
            if not self._member_started(self._key, pos, c):
                return False
        self._token_start = pos
        if c in "{[":
            self._stack.append(c)
            self._state = _OBJECT_START if c == "{" else _ARRAY_START
        elif c == '"':
            self._state, self._string_is_key = _STRING, False
        elif c in _NUMBER_STARTS:
            self._state = _NUMBER_TOKEN
        elif c in "tfn":
            self._state = _LITERAL_TOKEN
        else:
            return False
        return True

    def _string_closed(self, pos: int) -> bool:
        if not self._string_is_key:
            return self._value_ended(pos + 1)
        if len(self._stack) == 1:
            self._key = json.loads(self.text[self._key_start:pos + 1])  # already checked, so it decodes
        self._state = _COLON
        return True

    def _value_ended(self, end: int) -> bool:
        self._state = _AFTER_VALUE
        return len(self._stack) != 1 or self._member_ended(self._key, self._member_start, end)

    def _container_closed(self, pos: int) -> bool:
        self._stack.pop()
        if self._stack:
            return self._value_ended(pos + 1)
        if not self._object_closed(pos + 1):
            return False
        self.done = True
        return True


ARGUMENT_KEYS = ("arguments", "parameters")  # Llama's templates say "parameters"; either is accepted


class _CallObject(_JsonObject):
    """A call `{"name": "...", "arguments": {...}}` (other members are ignored), or, when the name came
    before the object (Mistral's newer format), the arguments object itself."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name
        self._is_arguments = name is not None
        self.arguments_start: int | None = 0 if self._is_arguments else None
        self.arguments_end: int | None = None
        self._name_seen = False

    @property
    def announceable(self) -> bool:
        """Whether the call is known to be one: its name is read and its arguments began as an object
        (or it has none)."""
        return self.name is not None and (self.arguments_start is not None or self.done)

    def arguments_read(self) -> int:
        """Where the arguments text read so far ends in `text`."""
        return self.arguments_end if self.arguments_end is not None else len(self.text)

    def _member_started(self, key: str | None, start: int, first: str) -> bool:
        if self._is_arguments:
            return True
        if key == "name":
            # A second name would make the one already streamed wrong.
            if self._name_seen:
                return False
            self._name_seen = True
            return first == '"'
        if key in ARGUMENT_KEYS:
            if self.arguments_start is not None or first != "{":
                return False
            self.arguments_start = start
        return True

    def _member_ended(self, key: str | None, start: int, end: int) -> bool:
        if self._is_arguments:
            return True
        if key == "name":
            self.name = json.loads(self.text[start:end])
            return bool(self.name)
        if key in ARGUMENT_KEYS:
            self.arguments_end = end
        return True

    def _object_closed(self, end: int) -> bool:
        if self._is_arguments:
            self.arguments_end = end
            return True
        return self.name is not None


# ---------------------------------------------------------------------------------------------------------
# Streams


class _TrimmedText:
    """Passes content on as `"".join(pieces).strip()` would end up, as early as it can: leading
    whitespace is dropped, trailing whitespace is held until something follows it."""

    def __init__(self) -> None:
        self._started = False
        self._spaces = ""

    def add(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._spaces += text
            return ""
        out = self._spaces + body
        self._spaces = text[len(body):]
        return out


def _skip_whitespace(text: str, i: int) -> int:
    found = _NOT_WHITESPACE.search(text, i)
    return found.start() if found else len(text)


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolStream:
    """One choice's streaming state. Subclasses implement a format as `_run` (read `_pending` as far as
    can be decided) and `_end` (the output ended)."""

    def __init__(self, eager: bool = True) -> None:
        # eager: announce a call before its object is complete (streaming); parse() waits for the end.
        self._eager = eager
        self._pending = ""  # received, not yet decided
        self._held = ""  # the marker and separators before the current call: content if it breaks
        self._call: _CallObject | None = None
        self._call_index: int | None = None  # set once the current call is announced
        self._arguments_sent = 0
        self._announced = 0
        self._content = _TrimmedText()
        self._out = StreamDelta()

    @property
    def called(self) -> bool:
        return self._announced > 0

    def feed(self, new_text: str) -> StreamDelta:
        self._pending += new_text
        self._run()
        return self._take()

    def finish(self) -> StreamDelta:
        self._end()
        self._pending = ""
        return self._take()

    def _run(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        return out

    def _emit_content(self, text: str) -> None:
        self._out.content += self._content.add(text)

    def _emit_pending(self) -> None:
        self._emit_content(self._pending)
        self._pending = ""

    def _until_marker(self, marker: str) -> bool:
        """Sends content up to `marker` and takes the marker (True), or sends all but a possible start of
        it (False)."""
        found = self._pending.find(marker)
        if found >= 0:
            self._emit_content(self._pending[:found])
            self._pending = self._pending[found + len(marker):]
            return True
        keep = len(self._pending) - _partial_marker_length(self._pending, marker)
        self._emit_content(self._pending[:keep])
        self._pending = self._pending[keep:]
        return False

    def _hold_whitespace(self) -> bool:
        """Moves leading whitespace from pending to held; whether a character follows it yet."""
        rest = self._pending.lstrip(_WHITESPACE)
        self._held += self._pending[:len(self._pending) - len(rest)]
        self._pending = rest
        return bool(rest)

    def _give_up(self) -> None:
        """The text held for a would-be call is content after all."""
        self._emit_content(self._held)
        self._held = ""

    def _start_call(self, name: str | None = None) -> None:
        self._call = _CallObject(name)

    def _read_call(self) -> bool | None:
        """Reads pending text into the current call: True once complete, False if it broke (its text is
        then content, unless already announced), None while it needs more."""
        call = self._call
        taken = call.feed(self._pending)
        self._pending = self._pending[taken:]
        self._send_call()
        if call.failed:
            if self._call_index is None:
                self._emit_content(self._held + call.text)
            self._close_call()
            return False
        if call.done:
            self._close_call()
            return True
        return None

    def _abandon_call(self) -> None:
        """The output ended inside a call."""
        if self._call_index is None:
            self._emit_content(self._held + self._call.text + self._pending)
        self._close_call()

    def _close_call(self) -> None:
        self._call, self._call_index, self._arguments_sent, self._held = None, None, 0, ""

    def _send_call(self) -> None:
        call = self._call
        deltas = self._out.tool_calls
        if self._call_index is None:
            if not call.announceable or not (self._eager or call.done):
                return
            self._call_index = self._announced
            self._announced += 1
            deltas.append(ToolCallDelta(self._call_index, new_call_id(), call.name))
        if call.arguments_start is None:
            piece = "{}" if call.done else ""
        else:
            piece = call.text[call.arguments_start + self._arguments_sent:call.arguments_read()]
        if not piece:
            return
        self._arguments_sent += len(piece)
        if deltas and deltas[-1].index == self._call_index:
            deltas[-1].arguments += piece
        else:
            deltas.append(ToolCallDelta(self._call_index, arguments=piece))


class _HermesStream(ToolStream):
    """Content, then `<tool_call>{...}</tool_call>` blocks. A missing closing tag is forgiven (output cut
    short, or the model went straight on), and text between or after the blocks is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._state = "content"

    def _run(self) -> None:
        while True:
            if self._state == "content":
                if not self._until_marker(self.OPEN):
                    return
                self._held = self.OPEN
                self._state = "open"
            elif self._state == "open":
                if not self._hold_whitespace():
                    return
                if self._pending[0] == "{":
                    self._start_call()
                    self._state = "call"
                else:
                    self._give_up()
                    self._state = "content"
            elif self._state == "call":
                complete = self._read_call()
                if complete is None:
                    return
                self._state = "close" if complete else "content"
            else:  # "close"
                rest = self._pending.lstrip(_WHITESPACE)
                if rest.startswith(self.CLOSE):
                    self._pending = rest[len(self.CLOSE):]
                elif self.CLOSE.startswith(rest):
                    return
                self._state = "content"

    def _end(self) -> None:
        if self._state == "content":
            self._emit_pending()
        elif self._state == "open":
            self._held += self._pending
            self._give_up()
        elif self._state == "call":
            self._abandon_call()
        # "close": whitespace and the start of a closing tag, which belong to the call


class _Llama3JsonStream(ToolStream):
    """The whole output is calls: after optional whitespace and `<|python_tag|>`, one or more objects
    separated by `;` (or just whitespace). Anything else from there on is content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._state = "start"

    def _run(self) -> None:
        while True:
            if self._state == "content":
                self._emit_pending()
                return
            if self._state == "call":
                complete = self._read_call()
                if complete is None:
                    return
                self._state = "between" if complete else "content"
                continue
            text = self._pending
            i = _skip_whitespace(text, 0)
            if self._state == "start":
                if text.startswith(self.PYTHON_TAG, i):
                    i = _skip_whitespace(text, i + len(self.PYTHON_TAG))
                elif self.PYTHON_TAG.startswith(text[i:i + len(self.PYTHON_TAG)]):
                    return  # nothing yet, or what may still become the tag
            elif text.startswith(";", i):
                i = _skip_whitespace(text, i + 1)
            if i == len(text):
                return
            if text[i] != "{":
                self._state = "content"
                continue
            self._held, self._pending = text[:i], text[i:]
            self._start_call()
            self._state = "call"

    def _end(self) -> None:
        if self._state in ("start", "content"):
            self._emit_pending()
        elif self._state == "call":
            self._abandon_call()
        # "between": whitespace and a `;` after the last call


class _MistralStream(ToolStream):
    """Content, then `[TOOL_CALLS]` and a JSON array of calls; or, in the format of Mistral's tokenizer
    v11 and later, `[TOOL_CALLS]name[ARGS]{arguments}` (`[ARGS]` is gone when special tokens are skipped
    in decoding). Either may repeat; text after the array or arguments is content."""

    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]*")

    def __init__(self, eager: bool = True) -> None:
        super().__init__(eager)
        self._state = "content"
        self._name = ""
        self._in_array = False

    def _run(self) -> None:
        while True:
            state = self._state
            if state == "content":
                if not self._until_marker(self.MARKER):
                    return
                self._held = self.MARKER
                self._state = "marker"
            elif state == "call":
                complete = self._read_call()
                if complete is None:
                    return
                self._state = "after element" if complete and self._in_array else "content"
            elif state == "name":
                name = self._NAME.match(self._pending).group()
                self._name += name
                self._held += name
                self._pending = self._pending[len(name):]
                if not self._pending:
                    return
                self._state = "after name"
            elif not self._hold_whitespace():
                return
            elif state == "marker":
                self._in_array = self._pending[0] == "["
                if self._in_array:
                    self._take_held(1)
                    self._state = "first element"
                elif self._NAME.match(self._pending).end():
                    self._name = ""
                    self._state = "name"
                else:
                    self._fail()
            elif state == "after name":
                if self._pending[0] == "{":
                    self._start_call(self._name)
                    self._state = "call"
                elif self._pending.startswith(self.ARGS):
                    self._take_held(len(self.ARGS))
                    self._state = "args"
                elif self.ARGS.startswith(self._pending):
                    return
                else:
                    self._fail()
            elif state == "args":
                if self._pending[0] == "{":
                    self._start_call(self._name)
                    self._state = "call"
                else:
                    self._fail()
            elif state in ("first element", "element"):
                if self._pending[0] == "{":
                    self._start_call()
                    self._state = "call"
                elif self._pending[0] == "]" and state == "first element":
                    self._pending = self._pending[1:]  # an empty list of calls: nothing to say
                    self._held = ""
                    self._state = "content"
                else:
                    self._fail()
            else:  # "after element"
                if self._pending[0] == ",":
                    self._take_held(1)
                    self._state = "element"
                else:
                    if self._pending[0] == "]":
                        self._pending = self._pending[1:]
                    self._held = ""  # whitespace after a complete call
                    self._state = "content"

    def _take_held(self, n: int) -> None:
        self._held += self._pending[:n]
        self._pending = self._pending[n:]

    def _fail(self) -> None:
        self._give_up()
        self._state = "content"

    def _end(self) -> None:
        if self._state == "content":
            self._emit_pending()
        elif self._state == "call":
            self._abandon_call()
        elif self._state != "after element":  # there, only whitespace after a complete call is left
            self._held += self._pending
            self._give_up()


# ---------------------------------------------------------------------------------------------------------
# Parsers


class ToolParser:
    name: str = ""
    _stream_class: type[ToolStream] = ToolStream

    def parse(self, text: str) -> ParsedOutput:
        stream = self._stream_class(eager=False)
        deltas = (stream.feed(text), stream.finish())
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            for piece in delta.tool_calls:
                if piece.id is not None:
                    calls[piece.index] = ToolCall(piece.name, piece.arguments, piece.id)
                else:
                    calls[piece.index].arguments += piece.arguments
        content = "".join(delta.content for delta in deltas)
        tool_calls = [calls[i] for i in sorted(calls)]
        return ParsedOutput(content if content or not tool_calls else None, tool_calls)

    def stream(self) -> ToolStream:
        return self._stream_class()


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks after optional content:
    Hermes 2 Pro, and Qwen2, 2.5 and 3, whose chat templates use this format (hence the `qwen` alias)."""

    name = "hermes"
    _stream_class = _HermesStream


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 JSON calls: `{"name": ..., "parameters": {...}}`, `;`-separated, as the whole output."""

    name = "llama3_json"
    _stream_class = _Llama3JsonStream


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after optional content. `[TOOL_CALLS]` is a
    special token, so it is only seen when the output is decoded with special tokens kept."""

    name = "mistral"
    _stream_class = _MistralStream


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; valid choices: {', '.join(PARSERS)}") from None
