"""The Responses API's memory: finished responses kept for `previous_response_id`, `GET` and `DELETE`.

A response is kept when its request said `store: true` (the default), with the conversation that a
follow-up continues: the chat messages it ran on (without its `instructions`, which OpenAI does not carry
over) and its own reply as an assistant turn. The store holds at most `--responses-store-size` responses
in memory; the least recently used one goes first. Nothing survives a restart.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class StoredResponse:
    response: dict  # the response object, as the create call returned it
    messages: list[dict]  # the conversation so far, as chat messages, ending with this response's reply


class ResponseStore:
    def __init__(self, size: int):
        self.size = size
        self._entries: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.size == 0:
            return
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
