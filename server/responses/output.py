"""A response's output items as they grow, and the stream events that announce them (OpenAI's Responses
API shapes and order).

1. `OutputItems.add(piece)` takes one step of a reply (server/replies/reader.py: thinking, answer text, tool-call
   pieces) and extends the output: a `reasoning` item, a `message` item with one `output_text` part, one
   `function_call` item per call, in the order the model wrote them. Opening an item closes the one
   before. It returns the events, in the documented order:
   `response.output_item.added` -> (`response.content_part.added` -> `response.output_text.delta`* |
   `response.reasoning_text.delta`* | `response.function_call_arguments.delta`*) -> the matching
   `.done` events -> `response.output_item.done`.
2. `close(status)` closes the open item (an empty reply still gets an empty message) and returns the last
   events. The non-streaming route builds the same items and drops the events, so both agree.
3. `Events` numbers every event (`sequence_number`) and writes it as SSE (`event:` and `data:` lines).
"""

from __future__ import annotations

import json
import uuid

from server.replies.reader import Piece


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Events:
    """`enabled=False`: the non-streaming route's, which writes nothing."""

    def __init__(self, enabled: bool = True):
        self.sequence = 0
        self.enabled = enabled

    def __call__(self, kind: str, **fields) -> str:
        if not self.enabled:
            return ""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class OutputItems:
    def __init__(self, events: Events):
        self.event = events
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self._positions: dict[str, int] = {}  # item id -> output_index

    def add(self, piece: Piece, logprobs: list | None = None) -> list[str]:
        out = []
        if piece.reasoning:
            out += self._ensure("reasoning")
            self.open["content"][0]["text"] += piece.reasoning
            out.append(self._event("response.reasoning_text.delta", content_index=0, delta=piece.reasoning))
        if piece.content or logprobs:
            out += self._ensure("message")
            part = self.open["content"][0]
            part["text"] += piece.content
            part["logprobs"] += logprobs or []
            out.append(self._event("response.output_text.delta", content_index=0, delta=piece.content,
                                   logprobs=logprobs or []))
        for delta in piece.tool_calls:
            if delta.name is not None:  # a new call
                out += self._close("completed")
                out += self._begin({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                    "call_id": delta.id, "name": delta.name, "arguments": ""})
            if delta.arguments:
                self.open["arguments"] += delta.arguments
                out.append(self._event("response.function_call_arguments.delta", delta=delta.arguments))
        return out

    def close(self, status: str) -> list[str]:
        """The end of the reply: `status` is the last item's ("completed", or "incomplete" when cut short)."""
        out = [] if self.items else self._ensure("message")
        return out + self._close(status)

    # ---- items ----------------------------------------------------------------------------------

    def _ensure(self, kind: str) -> list[str]:
        if self.open is not None and self.open["type"] == kind:
            return []
        out = self._close("completed")
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out += self._begin(item)
        item["content"].append(part)
        out.append(self._event("response.content_part.added", content_index=0, part=dict(part)))
        return out

    def _begin(self, item: dict) -> list[str]:
        self._positions[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        out = []
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item=item, arguments=item["arguments"],
                                   name=item["name"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self._event("response.reasoning_text.done", item=item, content_index=0, text=part["text"]))
            else:
                out.append(self._event("response.output_text.done", item=item, content_index=0, text=part["text"],
                                       logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", item=item, content_index=0, part=_copy(part)))
        item["status"] = status
        if item["type"] == "reasoning":
            item["encrypted_content"] = None
        out.append(self.event("response.output_item.done", output_index=self._positions[item["id"]], item=_copy(item)))
        return out

    def _event(self, kind: str, item: dict | None = None, **fields) -> str:
        item = item if item is not None else self.open
        return self.event(kind, item_id=item["id"], output_index=self._positions[item["id"]], **fields)


def _copy(value: dict) -> dict:
    """An event's snapshot of an item, unchanged by what is appended to the item later."""
    return json.loads(json.dumps(value))
