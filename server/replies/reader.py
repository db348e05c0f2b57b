"""One choice's reply as a client reads it — thinking, answer text, tool calls — whole or streamed; shared
by the chat and Responses routes.

1. `Replies(body, tool_call_parser, reasoning)` holds what a request decided: whether the reply starts
   in a thinking block (server/replies/reasoning.py), and how its answer turns into tool calls (server/tools/calls.py:
   a forced call, the server's auto parser, or plain text).
2. `stream()` gives one choice's reader: `feed(text, tokens)` splits the new text into thinking and answer,
   passes the answer through the tool-call reader and returns a `Piece`; `finish()` returns what was held
   back. It also counts the tokens spent thinking (the Responses API reports them).
3. `parse(text)` reads a whole reply into a `Reply` the same way.
"""

from __future__ import annotations

import dataclasses

from server.replies.reasoning import ReasoningParser
from server.tools.calls import replier
from server.tools.parsers import ToolCall, ToolCallDelta


@dataclasses.dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.reasoning + other.reasoning, self.content + other.content,
                     self.tool_calls + other.tool_calls)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclasses.dataclass
class Reply:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class Replies:
    def __init__(self, body, tool_call_parser: str | None, reasoning: ReasoningParser | None = None,
                 prompt: str = ""):
        self.calls = replier(body, tool_call_parser)  # None: the answer is plain text
        self.auto = body.tool_mode == "auto"
        self.include_reasoning = body.include_reasoning
        self.reasoning = reasoning
        self.thinking = reasoning is not None and reasoning.starts_thinking(prompt, body.chat_template_kwargs)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def parse(self, text: str) -> Reply:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.splitter(self.thinking).split(text)
        calls = self.calls.parse(text) if self.calls is not None else None
        if calls is not None and (calls.tool_calls or not self.auto):
            return Reply(self._shown(reasoning), calls.content, calls.tool_calls)
        return Reply(self._shown(reasoning), text, [])

    def _shown(self, reasoning: str | None) -> str | None:
        return reasoning if self.include_reasoning else None


class ChoiceStream:
    def __init__(self, replies: Replies):
        self.replies = replies
        self.splitter = replies.reasoning.splitter(replies.thinking) if replies.reasoning is not None else None
        self.calls = replies.calls.stream() if replies.calls is not None else None
        self.reasoning_tokens = 0

    @property
    def called(self) -> bool:
        """Some tool call has begun."""
        return bool(self.calls is not None and self.calls.called)

    @property
    def thinking(self) -> bool:
        return self.splitter is not None and self.splitter.thinking

    def feed(self, text: str, tokens: int = 0) -> Piece:
        if self.thinking:  # the step that writes the closing tag still thinks
            self.reasoning_tokens += tokens
        reasoning, answer = self.splitter.feed(text) if self.splitter is not None else ("", text)
        return self._piece(reasoning, answer)

    def finish(self) -> Piece:
        reasoning, answer = self.splitter.finish() if self.splitter is not None else ("", "")
        piece = self._piece(reasoning, answer)
        if self.calls is not None:
            last = self.calls.finish()
            piece += Piece("", last.content, last.tool_calls)
        return piece

    def _piece(self, reasoning: str, answer: str) -> Piece:
        reasoning = reasoning if self.replies.include_reasoning else ""
        if self.calls is None or not answer:
            return Piece(reasoning, answer)
        delta = self.calls.feed(answer)
        return Piece(reasoning, delta.content, delta.tool_calls)
