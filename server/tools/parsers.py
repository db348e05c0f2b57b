"""Tool calls in a model's chat output, for `tool_choice: "auto"`, under vLLM's `--tool-call-parser` names.

1. `get_parser(name)` gives the parser of one format: `hermes` (Hermes 2 Pro; `qwen` is the same parser,
   since the Qwen2, 2.5 and 3 chat templates use the Hermes format), `llama3_json` (Llama 3.1-3.3) or
   `mistral`. `parse()` splits a whole output into plain content and OpenAI tool calls; `stream()` gives
   one choice's state for doing the same piece by piece.
2. A small state machine per format reads the text left to right: plain content until the format's
   marker, then one JSON object per call. A strict JSON scanner (`json_scan.py`) checks that object a
   character at a time and notes where its "name" and "arguments" members lie: the arguments are returned
   exactly as the model wrote them ("{}" when it gave none), and a stream knows where they end as soon as
   they do.
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
import re
import secrets

from server.tools.json_scan import WHITESPACE, CallObject, TrimmedText, partial_marker_length, skip_whitespace


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


class ToolStream:
    """One choice's streaming state. Subclasses implement a format as `_run` (read `_pending` as far as
    can be decided) and `_end` (the output ended)."""

    def __init__(self, eager: bool = True) -> None:
        # eager: announce a call before its object is complete (streaming); parse() waits for the end.
        self._eager = eager
        self._pending = ""  # received, not yet decided
        self._held = ""  # the marker and separators before the current call: content if it breaks
        self._call: CallObject | None = None
        self._call_index: int | None = None  # set once the current call is announced
        self._arguments_sent = 0
        self._announced = 0
        self._content = TrimmedText()
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
        keep = len(self._pending) - partial_marker_length(self._pending, marker)
        self._emit_content(self._pending[:keep])
        self._pending = self._pending[keep:]
        return False

    def _hold_whitespace(self) -> bool:
        """Moves leading whitespace from pending to held; whether a character follows it yet."""
        rest = self._pending.lstrip(WHITESPACE)
        self._held += self._pending[:len(self._pending) - len(rest)]
        self._pending = rest
        return bool(rest)

    def _give_up(self) -> None:
        """The text held for a would-be call is content after all."""
        self._emit_content(self._held)
        self._held = ""

    def _start_call(self, name: str | None = None) -> None:
        self._call = CallObject(name)

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
                rest = self._pending.lstrip(WHITESPACE)
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
            i = skip_whitespace(text, 0)
            if self._state == "start":
                if text.startswith(self.PYTHON_TAG, i):
                    i = skip_whitespace(text, i + len(self.PYTHON_TAG))
                elif self.PYTHON_TAG.startswith(text[i:i + len(self.PYTHON_TAG)]):
                    return  # nothing yet, or what may still become the tag
            elif text.startswith(";", i):
                i = skip_whitespace(text, i + 1)
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
