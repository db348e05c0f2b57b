"""Reasoning output (`--reasoning-parser qwen3|deepseek_r1`): the thinking a model writes inside
`<think>...</think>`, returned apart from its answer, as vLLM's reasoning parsers return it.

1. `ReasoningParser.starts_thinking(prompt, template_kwargs)` says where a reply begins. A prompt that ends
   with the closing tag (Qwen3's template with `enable_thinking: false` writes an empty think block) or,
   for qwen3, a request with `enable_thinking: false` begins in the answer; otherwise the reply begins in
   the thinking, whether the prompt opened the block (DeepSeek-R1, Qwen3-Thinking) or the model will.
2. A `Splitter` per choice reads the reply as it streams: `feed(text)` returns the (thinking, answer) text
   that has become certain, holding back what may be the start of a tag; `finish()` returns the rest. A
   leading `<think>` the model writes itself is dropped (and opens the thinking even where the prompt had
   closed it, as vLLM reads such a reply); newlines around the thinking and at the start of the answer
   are trimmed, as the Qwen3 chat template trims them when it renders a past turn.
3. A reply whose thinking never closes (cut by max_tokens) is all thinking. The whole-text split is the
   same machine run over the whole text, so streamed and whole replies agree.
4. Structured outputs and tool calls apply to the answer: the server hands `END` to the grammar as its
   `reasoning_end` (jaxserve/sampling/grammar.py), and the tool-call parsers read only the answer text.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningParser:
    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
        self.name = name

    def starts_thinking(self, prompt: str, template_kwargs: dict | None) -> bool:
        """Whether the reply to `prompt` begins inside the thinking."""
        tail = prompt.rstrip()
        if tail.endswith(END):
            return False
        if self.name == "qwen3" and (template_kwargs or {}).get("enable_thinking") is False:
            return tail.endswith(START)  # a template that ignores the switch still opened the block
        return True

    def splitter(self, thinking: bool) -> Splitter:
        return Splitter(thinking)


class Splitter:
    """One reply's thinking and answer, split as the text arrives."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self._at_start = True  # a leading <think> may still come
        self._answer_started = False  # leading newlines of the answer are dropped until text comes
        self._reasoning_started = False
        self._held = ""  # text not yet certain: a possible tag start, or newlines that may end the thinking

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        if self._at_start:
            head = self._held.lstrip()
            if START.startswith(head):
                return "", ""  # maybe the model's own <think>: wait
            self._at_start = False
            if head.startswith(START):  # it thinks, even where the prompt said it would not
                self.thinking, self._held = True, head[len(START):]
        if not self.thinking:
            text, self._held = self._held, ""
            return "", self._answer(text)
        end = self._held.find(END)
        if end >= 0:
            reasoning, rest = self._held[:end], self._held[end + len(END):]
            self._held, self.thinking = "", False
            return self._reasoning(reasoning.rstrip("\n")), self._answer(rest)
        keep = _partial_suffix(self._held, END)
        ready, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        trailing = len(ready) - len(ready.rstrip("\n"))  # newlines are kept back: they may end the thinking
        if trailing:
            ready, self._held = ready[:-trailing], ready[-trailing:] + self._held
        return self._reasoning(ready), ""

    def finish(self) -> tuple[str, str]:
        """The text still held, once the reply has ended (an unclosed thinking keeps it all)."""
        held, self._held = self._held, ""
        if not self.thinking:
            return "", self._answer(held)
        if self._at_start and START.startswith(held.lstrip()):
            held = ""
        return self._reasoning(held.rstrip("\n")), ""

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply: (thinking, or None if it had none; answer)."""
        reasoning, answer = self.feed(text)
        more, rest = self.finish()
        return (reasoning + more) or None, answer + rest

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
