"""JSON read a character at a time, strictly, for the tool-call parsers (`parsers.py`).

1. `JsonObject` takes one JSON object piece by piece and says, after each piece, whether it is still valid,
   complete, or broken at a given character (no NaN, no raw control characters in strings: what any
   client's JSON parser accepts). Subclasses watch the root object's members as they are read.
2. `CallObject` is the object of one tool call: it notes where its "name" and "arguments" members lie, so
   the arguments can be returned exactly as the model wrote them and streamed as soon as they are read.
3. `TrimmedText` and the small helpers handle the plain content around the calls.
"""

from __future__ import annotations

import json
import re


WHITESPACE = " \t\n\r"  # JSON's, which is also what the formats allow around their markers
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
        if c in WHITESPACE:
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


class CallObject(_JsonObject):
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


class TrimmedText:
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


def skip_whitespace(text: str, i: int) -> int:
    found = _NOT_WHITESPACE.search(text, i)
    return found.start() if found else len(text)


def partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
