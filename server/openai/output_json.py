"""Reply pieces in OpenAI's (and vLLM's) JSON shapes: log-probabilities, tool calls, usage.

1. `completion_logprobs` is the legacy completions object (`tokens`, `token_logprobs`, `top_logprobs`,
   `text_offset`); with `echo` the prompt's tokens come first, the first of them without a logprob.
2. `chat_logprobs` is the chat object (`content`: per token its text, logprob, UTF-8 bytes and the top
   alternatives).
3. `prompt_logprobs_json` is vLLM's extension: per prompt token `{id: {logprob, rank, decoded_token}}`.
4. `tool_call_json` and `tool_call_delta_json` write a reply's tool calls, whole and as streamed pieces.
5. `Usage` counts tokens over a response's choices.
With `return_tokens_as_token_ids` a token is written `token_id:N`, so tokens that are not valid text on
their own (a UTF-8 fragment) can still be told apart.
"""

from __future__ import annotations

from jaxserve.outputs import PositionLogprobs, RequestOutput


def _name(token_id: int, text: str, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def _top(entries: PositionLogprobs, k: int) -> list[tuple[int, object]]:
    """The k most likely tokens of a position (by rank); the chosen one is in `entries` too."""
    return sorted(((t, e) for t, e in entries.items() if e.rank <= k), key=lambda item: item[1].rank)[:k]


def completion_logprobs(token_ids: list[int], entries: list[PositionLogprobs | None], k: int, token_str,
                        as_ids: bool = False) -> dict:
    """token_ids[i]'s entry is entries[i] (None: no logprob, the first prompt token)."""
    tokens, token_logprobs, top_logprobs, text_offset, offset = [], [], [], [], 0
    for token, entry in zip(token_ids, entries):
        text = token_str(token)
        tokens.append(_name(token, text, as_ids))
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry[token].logprob)
        top_logprobs.append({_name(t, e.decoded_token, as_ids): e.logprob for t, e in _top(entry, k)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(token_ids: list[int], entries: list[PositionLogprobs], k: int, token_str,
                  as_ids: bool = False) -> dict:
    def item(token: int, text: str, logprob: float) -> dict:
        name = _name(token, text, as_ids)
        return {"token": name, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token, entry in zip(token_ids, entries):
        chosen = item(token, token_str(token), entry[token].logprob)
        chosen["top_logprobs"] = [item(t, e.decoded_token, e.logprob) for t, e in _top(entry, k)]
        content.append(chosen)
    return {"content": content}


def prompt_logprobs_json(entries: list[PositionLogprobs | None] | None) -> list | None:
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
                                    for t, v in e.items()} for e in entries]


def tool_call_json(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(delta) -> dict:
    """A streamed piece of a tool call: its first piece carries the id and name, later ones argument text."""
    out = {"index": delta.index}
    if delta.id is not None:
        out.update(id=delta.id, type="function")
    function = {"arguments": delta.arguments}
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out


class Usage:
    """Token counts of one response: prompts once each (not per choice), completions over every choice."""

    def __init__(self, prompt_ids: list[list[int]]):
        self.prompt_tokens = sum(len(p) for p in prompt_ids)
        self.completion: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def add(self, choice: int, out: RequestOutput, counted: bool = True) -> None:
        self.completion[choice] = out.num_output_tokens if counted else 0
        if out.index == 0:
            self.cached[choice] = out.num_cached_tokens

    def as_dict(self) -> dict:
        done = sum(self.completion.values())
        # prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix cache (OpenAI's field).
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}

