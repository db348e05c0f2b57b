"""What the engine hands back, in vLLM's shapes: per-step deltas while a choice runs, the whole result at its end.

1. `RequestOutput` is one event of one choice of a request: the text that became final and the token ids
   (with their log-probabilities, when asked for) new in this step, and, once the choice is finished,
   the whole `CompletionOutput`. A request with n choices produces events for each; `finished` is per
   choice. Nothing here copies a choice's whole output until it ends.
2. `Logprob` is one entry of a position's dict `{token id: Logprob}` (the chosen token and the top
   alternatives), and `logprob_entries` builds those dicts from a step's fetched results.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


PositionLogprobs = dict[int, Logprob]  # token id -> Logprob: the chosen token and the top alternatives


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n choices
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the EOS/stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked for
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs, when asked for


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the whole result of this choice, once finished; empty before
    finished: bool  # this choice is finished
    new_text: str = ""  # text that became final in this step (for streaming)
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    new_logprobs: list[PositionLogprobs] | None = None  # for new_token_ids, when asked for
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_output_tokens: int = 0  # tokens this choice generated so far
    queue_seconds: float | None = None  # from queueing to its first admission (None if never admitted)
    index: int = 0  # the choice (0 .. n - 1)
    # Per prompt token (None for the first), when asked for; on choice 0's first event and final output.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


def logprob_entries(chosen: int, logprob: float, rank: int, top_ids: np.ndarray, top_logprobs: np.ndarray,
                    k: int, token_str) -> PositionLogprobs:
    """One position's dict: the chosen token first, then the k most likely (ranks 1..k)."""
    entries = {int(chosen): Logprob(float(logprob), int(rank), token_str(int(chosen)))}
    for r in range(k):
        token = int(top_ids[r])
        if token not in entries:
            entries[token] = Logprob(float(top_logprobs[r]), r + 1, token_str(token))
    return entries
