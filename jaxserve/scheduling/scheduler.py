"""Continuous-batching scheduler: host-only Python, no device arrays.

1. Requests wait in arrival order. One is admitted when a slot is free and the pages for its whole
   prefill (prompt, plus any tokens it generated before a preemption) can be allocated. With prefix
   caching, the longest cached run of full pages of those tokens is shared instead of allocated, and
   prefill starts after it. The hit stops short of the last token: its logits are needed to sample, so
   at least that token is always computed, in a page of its own request. The other choices of an n > 1
   request wait until choice 0 has its prompt prefilled, then start from its prompt pages (shared, one
   reference each) and compute only the rest of the prompt, whose last token each samples itself.
2. Each iteration `schedule()` fills one step up to the token budget (`max_num_batched_tokens`): first
   one token for every decoding sequence (each gets the page that token goes to; when none is free the
   newest running request is preempted and will be recomputed), then prefill chunks of as many
   prefilling sequences as fit, oldest first. The step is a list of `ScheduledChunk`s: one ragged batch.
3. Scheduling runs one step ahead of the host's knowledge (asynchronous scheduling): the step it plans
   is dispatched while the previous one still runs, so a sequence's newest token may still be on the
   device. Such a token is *pending*: the chunk names the previous step's sample row it comes from, and
   the device feeds it in directly. `num_computed` counts tokens whose K/V the dispatched steps write.
   A sequence under structured outputs is not decoded while it has a pending token: the grammar mask of
   its next draw depends on that token (the engine reads it first, see engine.py).
4. When a step's samples reach the host, `accept_token` appends them — the only place a request's tokens
   grow. A sample for a request that finished, was aborted or was preempted after the step was planned
   is discarded (its `epoch` moved on). Full pages whose tokens are all known and whose K/V is written
   by a dispatched step are offered to the prefix cache, prompt and generated text alike.
5. `finish` frees a finished or aborted request's slot and pages; pages holding a cached prefix stay
   cached until an allocation needs them (least recently used first). A step still in flight may write
   into freed pages, but every later step runs after it on the device, so their next owner's writes win.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from collections import deque

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduling.pages import PageAllocator, pages_needed
from jaxserve.scheduling.prefix_cache import extend_page_keys, PageKey, PrefixCache
from jaxserve.sampling.params import SamplingParams, seed_words


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_len: int  # prompt + completion may not exceed this (max_tokens and the context, combined)
    token_ids: list[int] = dataclasses.field(default_factory=list)  # prompt, then every known output token
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V the dispatched steps write
    num_pending: int = 0  # tokens sampled by dispatched steps that the host has not read yet
    pending_row: int = -1  # sample row of the last dispatched step that holds the pending token
    prefill_target: int = 0  # tokens to prefill since the last admission
    epoch: int = 0  # bumped when the request stops running: samples planned before are discarded
    finish_reason: str | None = None
    num_preemptions: int = 0
    page_keys: list[PageKey] = dataclasses.field(default_factory=list)  # prefix-cache keys of full pages
    num_registered: int = 0  # leading pages whose keys the cache has seen since the last admission
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrival))
    # Seconds from queueing to the first admission (for metrics); None until then.
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    queue_seconds: float | None = None
    admitted_at: int = 0  # num_computed right after the last admission: where its first chunk starts
    suppress_ids: tuple[int, ...] = ()  # EOS and stop tokens: masked while fewer than min_tokens are out
    bias_table: tuple | None = None  # (ids, values, kinds) of its static bias entries, built by the batch
    # Choices 1..n-1 of an n > 1 request, forked from this one (choice 0) once its prompt is prefilled;
    # `shared_pages` are the prompt pages a forked choice starts from (acquired for it at the fork).
    choice: int = 0
    forks: list["Request"] = dataclasses.field(default_factory=list)
    shared_pages: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        self.seed_words = seed_words(self.seed)

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
        """Known tokens plus those still on the device."""
        return len(self.token_ids) + self.num_pending

    @property
    def constrained(self) -> bool:
        """Its draws follow a grammar: each needs the token before it known on the host (for the mask)."""
        return self.params.structured_outputs is not None

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


@dataclasses.dataclass
class ScheduledChunk:
    """One sequence's share of a step: `num_tokens` new tokens at positions start, start + 1, ..."""
    request: Request
    start: int
    num_tokens: int
    token_ids: list[int] | None  # the new tokens, or None: one token from the previous step's `prev_row`
    prev_row: int  # -1 unless token_ids is None
    sample_step: int  # index among the request's outputs of the token sampled after this chunk; -1 = none
    epoch: int
    is_prefill: bool
    first: bool = False  # the request's first chunk since its (re)admission: its sampler state starts over

    @property
    def samples(self) -> bool:
        return self.sample_step >= 0

    @classmethod
    def for_sequence(cls, slot: int, pages: list[int], start: int, token_ids: list[int],
                     params: SamplingParams | None = None, seed: int = 0) -> "ScheduledChunk":
        """A chunk for a sequence no scheduler manages (research, tests): `token_ids` at positions
        start.. of the sequence whose K/V lives in `pages`, using page-table row `slot`; the token after
        them is sampled (greedy unless `params` say otherwise)."""
        # Positions before `start` are already in the cache; their ids do not matter here.
        request = Request(f"slot{slot}", [0] * start + list(token_ids),
                          params or SamplingParams(temperature=0, max_tokens=None), seed=seed,
                          max_len=start + len(token_ids) + 1)
        request.status, request.slot, request.pages = Status.RUNNING, slot, list(pages)
        return cls(request, start, len(token_ids), list(token_ids), -1, 0, request.epoch, True, first=True)


@dataclasses.dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    num_tokens: int

    @property
    def empty(self) -> bool:
        return not self.chunks

    @property
    def prefill_only(self) -> bool:
        """No chunk decodes: every request in the step is still reading its prompt."""
        return all(chunk.is_prefill for chunk in self.chunks)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig):
        self.config = scheduler_config
        self.page_size = cache_config.page_size
        self.prefix_cache = PrefixCache() if cache_config.enable_prefix_caching else None
        self.allocator = PageAllocator(cache_config.num_pages, self.prefix_cache)
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * scheduler_config.max_num_seqs
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache (counted at admission)
        self.prefix_cache_hits = 0  # of those, tokens whose K/V came from the cache
        # Tokens one step may hold: the config's budget, lowered by the engine while step programs compile.
        self.token_budget = scheduler_config.max_num_batched_tokens

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def num_free_slots(self) -> int:
        return self.slots.count(None)

    def kv_usage(self) -> float:
        return 1 - self.allocator.num_free / self.allocator.num_usable

    # ---- planning ----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> StepPlan:
        """Plan the next step; marks what it schedules as computed (and sampled) right away."""
        preempted = self._reserve_decode_pages()
        chunks: list[ScheduledChunk] = []
        budget = self.token_budget
        running = sorted(self.running, key=lambda r: r.arrival)
        for request in running:
            if self._wants_decode(request):
                chunks.append(self._decode_chunk(request, len(chunks)))
        budget -= len(chunks)
        if not preempted:  # pages just freed by a preemption go to the running requests first
            self._admit()
            running = sorted(self.running, key=lambda r: r.arrival)
        for request in running:
            if budget == 0:
                break
            if request.is_prefilling:
                n = min(request.prefill_target - request.num_computed, budget)
                chunks.append(self._prefill_chunk(request, n, len(chunks)))
                budget -= n
        return StepPlan(chunks, self.token_budget - budget)

    @staticmethod
    def _wants_decode(request: Request) -> bool:
        # A sequence at its length limit only waits for its pending token, which finishes it. A constrained
        # one waits for its pending token too: its next draw's mask depends on it.
        return (request.is_decoding and request.num_tokens < request.max_len
                and not (request.constrained and request.num_pending))

    def _decode_chunk(self, request: Request, row: int) -> ScheduledChunk:
        pending = request.num_pending > 0
        chunk = ScheduledChunk(request, request.num_computed, 1,
                               None if pending else request.token_ids[-1:],
                               request.pending_row if pending else -1,
                               request.num_tokens - request.num_prompt_tokens, request.epoch, False)
        request.num_computed += 1
        self._mark_sampled(request, row)
        return chunk

    def _prefill_chunk(self, request: Request, n: int, row: int) -> ScheduledChunk:
        start = request.num_computed
        last = start + n == request.prefill_target
        chunk = ScheduledChunk(request, start, n, request.token_ids[start:start + n], -1,
                               request.num_tokens - request.num_prompt_tokens if last else -1, request.epoch,
                               True, first=start == request.admitted_at)
        request.num_computed += n
        if last:
            self._mark_sampled(request, row)
            if request.forks:
                self._fork(request)
        return chunk

    @staticmethod
    def _mark_sampled(request: Request, row: int) -> None:
        request.num_pending += 1
        request.pending_row = row

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            request = self.waiting[0]
            target = len(request.token_ids)
            forked = bool(request.shared_pages)  # its prompt's pages come from choice 0, already held
            hits = request.shared_pages if forked else self._cached_prefix(request, target)
            fresh = pages_needed(target, self.page_size) - len(hits)
            # Idle hit pages count as free until acquired: they must not also pay for the fresh pages.
            idle_hits = sum(self.prefix_cache.is_idle(p) for p in hits) if hits and not forked else 0
            if not self.allocator.can_allocate(fresh + idle_hits):
                return  # wait for pages: strict arrival order, so big prompts are not starved
            if not forked:
                self.allocator.acquire(hits)
            pages = hits + self.allocator.allocate(fresh)
            self.waiting.popleft()
            request.shared_pages = []
            request.status = Status.RUNNING
            request.slot = self.slots.index(None)
            request.pages = pages
            request.num_computed = request.admitted_at = len(hits) * self.page_size
            request.num_registered = len(hits)
            request.prefill_target = target
            if request.num_cached_tokens is None:
                request.num_cached_tokens = 0 if forked else request.num_computed
                request.queue_seconds = time.monotonic() - request.queued_at
            if self.prefix_cache is not None and not forked:
                self.prefix_cache_queries += target
                self.prefix_cache_hits += request.num_computed
            self.slots[request.slot] = request

    def _fork(self, request: Request) -> None:
        """Choice 0's prompt is prefilled (by the step being planned): its other choices may start. They
        share its whole prompt pages (one more reference each) and compute the rest themselves, at least
        the last prompt token, whose logits each samples with its own seed."""
        full = (request.num_prompt_tokens - 1) // self.page_size
        # A repetition penalty needs every prompt token to pass through the step (it marks them).
        shared = request.pages[:full] if request.params.repetition_penalty == 1 else []
        for choice in request.forks:
            self.allocator.acquire(shared)
            choice.shared_pages = list(shared)
            self._requeue(choice)
        request.forks = []

    def _cached_prefix(self, request: Request, target: int) -> list[int]:
        """Pages of the longest cached prefix usable for the first `target` tokens of the request."""
        params = request.params
        if self.prefix_cache is None or params.repetition_penalty != 1 or params.prompt_logprobs is not None:
            return []  # a repetition penalty (prompt logprobs) needs every prompt token to go through a step
        # At most target - 1 tokens, in whole pages: the last token is computed for its logits, and it
        # and everything after it land in pages this request owns alone.
        usable = (target - 1) // self.page_size
        extend_page_keys(request.page_keys, request.token_ids, self.page_size, usable, self._extra_keys(request))
        return self.prefix_cache.lookup(request.page_keys[:usable])

    @staticmethod
    def _extra_keys(request: Request) -> tuple:
        salt = request.params.cache_salt
        return ("salt", salt) if salt is not None else ()

    def register_full_pages(self, request: Request) -> None:
        """Offer the prefix cache every page that is full of known tokens whose K/V a dispatched step
        writes. Later readers run after that step on the device, so they see the K/V."""
        if self.prefix_cache is None or request.status is not Status.RUNNING:
            return
        full = min(request.num_computed, len(request.token_ids)) // self.page_size
        if full <= request.num_registered:
            return
        keys = extend_page_keys(request.page_keys, request.token_ids, self.page_size, full,
                                self._extra_keys(request))
        for i in range(request.num_registered, full):
            self.prefix_cache.register(request.pages[i], keys[i])
        request.num_registered = full

    def _reserve_decode_pages(self) -> bool:
        """Give every decoding sequence the page its next token goes to, preempting if need be. Returns
        whether anything was preempted."""
        preempted = False
        for request in sorted((r for r in self.slots if r is not None and self._wants_decode(r)),
                              key=lambda r: r.arrival):
            while request.status is Status.RUNNING and request.num_computed // self.page_size >= len(request.pages):
                page = self.allocator.allocate(1)
                if page is not None:
                    request.pages += page
                else:
                    self._preempt(max(self.running, key=lambda r: r.arrival))
                    preempted = True
        return preempted

    def _preempt(self, victim: Request) -> None:
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_computed = 0
        victim.num_pending = 0  # its in-flight sample is discarded and drawn again after recomputation
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(victim)

    def _requeue(self, request: Request) -> None:
        """Back to the front of the queue, in arrival order among the requests that arrived before."""
        position = next((i for i, r in enumerate(self.waiting) if r.arrival > request.arrival), len(self.waiting))
        self.waiting.insert(position, request)

    def _release(self, request: Request) -> None:
        request.epoch += 1
        request.pending_row = -1
        if request.shared_pages:  # a forked choice that never ran
            self.allocator.free(request.shared_pages)
            request.shared_pages = []
        if request.slot is not None:
            self.slots[request.slot] = None
            request.slot = None
        if request.pages:
            self.allocator.free(request.pages)
            request.pages = []

    # ---- results -------------------------------------------------------------------------------------

    def accept_token(self, chunk: ScheduledChunk, token: int) -> bool:
        """A step's sample for `chunk` reached the host. Returns False (and drops it) when the request has
        stopped running since the step was planned."""
        request = chunk.request
        if request.epoch != chunk.epoch:
            return False
        request.num_pending -= 1
        request.token_ids.append(token)
        self.register_full_pages(request)
        return True

    def reset_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use keep theirs); returns how many were evicted."""
        return self.allocator.evict_cached()

    def finish(self, request: Request, reason: str) -> None:
        """Finish (or abort) a request wherever it is; frees its slot and pages. Choices not forked yet are
        the caller's to finish."""
        if request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.forks = []
        self.register_full_pages(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.num_pending = 0
