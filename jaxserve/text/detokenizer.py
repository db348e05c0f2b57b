"""Streaming detokenization: each sampled id becomes the text that will not change any more.

1. One `IncrementalDetokenizer` per choice (`Tokenizer.new_detokenizer`) takes the completion ids one at a
   time and returns the text that became final, never splitting a multi-byte UTF-8 character.
2. Each call decodes only a short window of recent ids, so its cost does not grow with the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    """Turns completion ids, one at a time, into text that will not change any more.

    Each step decodes only a short window: ids[prefix:read] were already emitted and serve as
    context, ids[read:] are new. The new text is the window's decode minus the context's decode.
    The context matters because decoding is not local: a SentencePiece decoder drops the
    leading space of the first piece of each decode call, and bytes of one character may sit
    in several tokens. Text is held back while the window ends in U+FFFD (maybe a character
    whose remaining bytes have not been sampled yet).
    """

    # Prompt ids used as context for the first completion id.
    _CONTEXT = 5
    # How far a window start may move back to reach a clean boundary (see _window_start).
    _MAX_BACKTRACK = 8

    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # With skip_special_tokens the decoder never sees special ids, so leaving them out of
        # the window gives the same text and keeps a run of them from widening the window.
        self._hidden = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids = [i for i in map(int, prompt_ids) if i not in self._hidden]
        self._read = len(self._ids)
        self._prefix, self._prefix_text = self._window_start(self._read - self._CONTEXT, self._read)
        self._chunks: list[str] = []
        self.token_ids: list[int] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (joined lazily: appending to one str per token is O(n^2))."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Add one completion id; return the text that became final (often "")."""
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if token_id in self._hidden:
            return ""
        self._ids.append(token_id)
        window_text = self._decode(self._prefix, len(self._ids))
        if window_text.endswith(_REPLACEMENT) or len(window_text) <= len(self._prefix_text):
            return ""  # an unfinished character, or nothing visible yet: wait for more ids
        return self._emit(window_text)

    def flush(self) -> str:
        """At the end of the sequence: emit whatever was held back, as a full decode would."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._prefix, len(self._ids)))

    def _emit(self, window_text: str) -> str:
        new_text = window_text[len(self._prefix_text):]
        if new_text:
            self._chunks.append(new_text)
        # The ids just emitted become the next window's context.
        self._prefix, self._prefix_text = self._window_start(self._read, len(self._ids))
        self._read = len(self._ids)
        return new_text

    def _window_start(self, start: int, end: int) -> tuple[int, str]:
        """Choose where a window ending at `end` begins, and return that context's text.

        Move back from `start` while the context decodes to "" (a space-stripping decoder would
        then drop the next piece's space, which a full decode keeps) or begins with U+FFFD (the
        start is inside a multi-byte character). A window that reaches id 0 is exact anyway.
        """
        pos = max(start, 0)
        lowest = max(pos - self._MAX_BACKTRACK, 0)
        text = self._decode(pos, end)
        while pos > lowest and (not text or text.startswith(_REPLACEMENT)):
            pos -= 1
            text = self._decode(pos, end)
        return pos, text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)
