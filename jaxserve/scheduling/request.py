"""A request as the engine keeps it: one `Request` per choice, from admission to its final output.

A caller's request with n choices becomes n `Request`s that share its `request_id` and differ in `index`
(and seed); each has a `key`, unique in the process, which steps name it by. Its state has three owners,
and nothing else writes it:
1. The scheduler (`scheduler.py`): where it runs (status, slot, pages) and what the dispatched steps
   compute (`num_computed`, `num_pending`, the prefix-cache keys of its full pages).
2. `update_from_output` (`update.py`): its history (`token_ids`), its finish, and its `output`: text
   emitted so far, stop-string state, log-probabilities. It is the only place a request's tokens grow.
3. Its `grammar` (structured outputs): where the output stands in the grammar and how it will close.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Protocol

from jaxserve.outputs import PositionLogprobs
from jaxserve.sampling.closing import GrammarState
from jaxserve.sampling.params import BiasTable, SamplingParams, bias_table, seed_words
from jaxserve.scheduling.prefix_cache import PageKey


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_keys = itertools.count()


@dataclasses.dataclass(eq=False)
class OutputState:
    """What `update_from_output` assembles for the caller, besides the token ids."""
    detokenizer: object | None = None  # IncrementalDetokenizer (None: no text, e.g. scheduler tests)
    pieces: list[str] = dataclasses.field(default_factory=list)  # emitted text; joined once, at the end
    held: str = ""  # text withheld because it might be the start of a stop string
    logprobs: list[PositionLogprobs] | None = None  # per output token, when asked for
    cumulative_logprob: float = 0.0
    # Choice 0 collects them (position 0 has none); they go out with its first event and its end.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False


class HeadState(Protocol):
    """What a request for an output head that draws nothing keeps: its settings and partial result
    (`jaxserve/execution/heads/`)."""
    setting: int  # its per-sequence input of the head, copied into each of its spans (`ScheduledSeq.head_setting`)
    needs_every_token: bool  # the head reads every prompt token's hidden state: no prefix-cache hits


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str  # the caller's id, shared by the request's choices
    prompt_ids: list[int]
    params: SamplingParams | None  # None: a request whose result is not drawn tokens (`head_state` says what)
    seed: int
    max_len: int  # prompt + completion may not exceed this (max_tokens and the context, combined)
    index: int = 0  # which of the request's n choices
    prompt: str | None = None  # the prompt's text, when the caller gave text
    suppress_ids: tuple[int, ...] = ()  # EOS and stop tokens: masked while fewer than min_tokens are out
    priority: int = 0  # --scheduling-policy priority: lower runs first (ties by arrival)
    # -- history: update_from_output alone appends ----------------------------------------------------
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt, then every known output token
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the EOS / stop token or stop string that ended it
    output: OutputState = dataclasses.field(default_factory=OutputState)
    grammar: GrammarState | None = None  # structured outputs: its place in the grammar
    lora: object | None = None  # its LoRA adapter (`jaxserve.lora.manager.ActiveLoRA`); None: the base model
    images: tuple = ()  # its prompt's images (`scheduling/images.ImageSpan`), in prompt order
    mrope: object = None  # its prompt's M-RoPE positions (`model/mrope.PromptPositions`); None: 1-D (index)
    # -- scheduling: the scheduler alone writes these ---------------------------------------------------
    slot: int | None = None
    lora_slot: int = 0  # the device slot of its adapter while admitted; 0: none
    pages: list[int] = dataclasses.field(default_factory=list)
    num_pages_sent: int = 0  # leading pages the steps so far have told the device's page table about
    num_computed: int = 0  # tokens whose K/V the dispatched steps write
    num_pending: int = 0  # dispatched draws whose tokens the host has not read yet
    pending_row: int = -1  # sample row of the last dispatched step that holds the pending token
    prefill_target: int = 0  # tokens to prefill since the last admission
    admitted_at: int = 0  # num_computed right after the last admission: where its first chunk starts
    epoch: int = 0  # bumped when the request stops running: samples planned before are discarded
    num_preemptions: int = 0
    page_keys: list[PageKey] = dataclasses.field(default_factory=list)  # prefix-cache keys of full pages
    num_registered: int = 0  # leading pages whose keys the cache has seen since the last admission
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    # Seconds from queueing to the first admission (for metrics); None until then.
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    queue_seconds: float | None = None
    # Choices 1..n-1, forked from this one (choice 0) once its prompt is prefilled; `shared_pages` are the
    # prompt pages a forked choice starts from (acquired for it at the fork).
    forks: list["Request"] = dataclasses.field(default_factory=list)
    shared_pages: list[int] = dataclasses.field(default_factory=list)
    # Speculative decoding: tokens a proposer drafted after the last known one, to be verified by the
    # next step (scheduled as part of its span; none are proposed yet).
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)
    # A request of an output head that draws nothing: its settings and partial result, which only that
    # head's host update reads and writes (`execution/heads/`); None: its tokens are drawn.
    head_state: HeadState | None = None
    key: int = dataclasses.field(default_factory=lambda: next(_keys))  # unique: arrival order, and the steps' name

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.seed_words = seed_words(self.seed)
        self.bias: BiasTable = bias_table(self.params) if self.params is not None else ((), (), ())

    @property
    def arrival(self) -> int:
        return self.key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        """Known output tokens (pending ones excluded)."""
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_tokens(self) -> int:
        """Known tokens plus one per draw still on the device."""
        return len(self.token_ids) + self.num_pending

    @property
    def constrained(self) -> bool:
        """Its draws follow a grammar: each needs the token before it known on the host (for the mask)."""
        return self.params is not None and self.params.structured_outputs is not None

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs."""
        return self.params is not None and self.params.prompt_logprobs is not None

    @property
    def needs_every_token(self) -> bool:
        """Every prompt token must go through a step, so no prefix-cache hits: a repetition penalty marks them,
        prompt logprobs score them, an output head may read them all (`HeadState.needs_every_token`)."""
        if self.head_state is not None:
            return self.head_state.needs_every_token
        return self.params.repetition_penalty != 1 or self.scores_prompt

    @property
    def cache_salt(self) -> str | None:
        return None if self.params is None else self.params.cache_salt

    @property
    def is_prefilling(self) -> bool:
        return self.status is Status.RUNNING and self.num_computed < self.prefill_target

    @property
    def is_decoding(self) -> bool:
        """Running with exactly one token (known or pending) not yet fed to the model."""
        return self.status is Status.RUNNING and self.num_computed == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
