"""Continuous-batching scheduler: host-only Python, no device arrays.

1. Requests wait in arrival order. One is admitted when a decode slot is free and the pages for its whole
   prefill (prompt, plus any tokens it already generated before a preemption) can be allocated. With
   prefix caching, the longest cached run of full pages of those tokens is shared instead of allocated,
   and prefill starts after it (a chunk at q_start > 0). The hit stops short of the last token: its
   logits are needed to sample, so at least that token is always computed, in a page of its own request.
2. Each iteration `schedule()` returns a `Plan`: at most one prefill chunk (bounded by the largest
   bucket, oldest request first) plus one decode step over every slot whose prefill is done. A long
   prompt therefore never stalls the streams already running.
3. Before a decode step each sequence gets the page its next token needs. When none is free the newest
   running request is preempted: its pages and slot are freed and it waits, at the front of the queue,
   to be recomputed later. Memory pressure that can be waited out never fails a request.
4. After the step, `update_prefill` / `update_decode` advance request state — the only place it
   changes — and register every page the step filled in the prefix cache, prompt and generated text
   alike (the next turn of a chat reuses both). Only full, written pages are registered, and a request
   only ever writes at or after its first unshared page, so a shared page is never written.
5. `finish` frees a finished or aborted request's slot and pages; pages holding a cached prefix stay
   cached until an allocation needs them (least recently used first).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import deque

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.kv_cache import PageAllocator, pages_needed
from jaxserve.prefix_cache import PageKey, PrefixCache, extend_page_keys
from jaxserve.sampling import SamplingParams


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
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    prefill_target: int = 0  # tokens to prefill since the last admission
    finish_reason: str | None = None
    num_preemptions: int = 0
    page_keys: list[PageKey] = dataclasses.field(default_factory=list)  # prefix-cache keys of full pages
    num_registered: int = 0  # leading pages whose keys the cache has seen since the last admission
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    arrival: int = dataclasses.field(default_factory=lambda: next(_arrival))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_prefilling(self) -> bool:
        return self.status is Status.RUNNING and self.num_computed < self.prefill_target

    @property
    def is_decoding(self) -> bool:
        return self.status is Status.RUNNING and self.num_computed >= self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass
class PrefillWork:
    request: Request
    start: int  # position of the chunk's first token
    token_ids: list[int]

    @property
    def is_last_chunk(self) -> bool:
        return self.start + len(self.token_ids) == self.request.prefill_target


@dataclasses.dataclass
class Plan:
    prefill: PrefillWork | None
    decode: list[Request | None]  # one entry per slot; None = idle or still prefilling

    @property
    def empty(self) -> bool:
        return self.prefill is None and not any(self.decode)


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

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def num_free_slots(self) -> int:
        return self.slots.count(None)

    def kv_usage(self) -> float:
        return 1 - self.allocator.num_free / self.allocator.num_usable

    # ---- mutations -------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> Plan:
        self._admit()
        self._reserve_decode_pages()
        prefilling = sorted((r for r in self.slots if r is not None and r.is_prefilling), key=lambda r: r.arrival)
        prefill = None
        if prefilling:
            r = prefilling[0]
            end = min(r.prefill_target, r.num_computed + self.config.max_prefill_chunk)
            prefill = PrefillWork(r, r.num_computed, r.all_ids[r.num_computed:end])
        decode = [r if r is not None and r.is_decoding else None for r in self.slots]
        return Plan(prefill=prefill, decode=decode)

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            request = self.waiting[0]
            target = len(request.all_ids)
            hits = self._cached_prefix(request, target)
            fresh = pages_needed(target, self.page_size) - len(hits)
            # Idle hit pages count as free until acquired: they must not also pay for the fresh pages.
            idle_hits = sum(self.prefix_cache.is_idle(p) for p in hits) if hits else 0
            if not self.allocator.can_allocate(fresh + idle_hits):
                return  # wait for pages: strict arrival order, so big prompts are not starved
            self.allocator.acquire(hits)
            pages = hits + self.allocator.allocate(fresh)
            self.waiting.popleft()
            request.status = Status.RUNNING
            request.slot = self.slots.index(None)
            request.pages = pages
            request.num_computed = len(hits) * self.page_size
            request.num_registered = len(hits)
            request.prefill_target = target
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed
            if self.prefix_cache is not None:
                self.prefix_cache_queries += target
                self.prefix_cache_hits += request.num_computed
            self.slots[request.slot] = request

    def _cached_prefix(self, request: Request, target: int) -> list[int]:
        """Pages of the longest cached prefix usable for the first `target` tokens of the request."""
        if self.prefix_cache is None:
            return []
        # At most target - 1 tokens, in whole pages: the last token is computed for its logits, and it
        # and everything after it land in pages this request owns alone.
        usable = (target - 1) // self.page_size
        extend_page_keys(request.page_keys, request.all_ids, self.page_size, usable, self._extra_keys(request))
        return self.prefix_cache.lookup(request.page_keys[:usable])

    @staticmethod
    def _extra_keys(request: Request) -> tuple:
        salt = request.params.cache_salt
        return ("salt", salt) if salt is not None else ()

    def _register_full_pages(self, request: Request) -> None:
        """Offer every page the last step completed to the prefix cache (after the step: K/V written)."""
        if self.prefix_cache is None:
            return
        full = request.num_computed // self.page_size
        if full <= request.num_registered:
            return
        keys = extend_page_keys(request.page_keys, request.all_ids, self.page_size, full,
                                self._extra_keys(request))
        for i in range(request.num_registered, full):
            self.prefix_cache.register(request.pages[i], keys[i])
        request.num_registered = full

    def _reserve_decode_pages(self) -> None:
        """Give every decoding sequence the page its next token goes to, preempting if need be."""
        for request in sorted((r for r in self.slots if r is not None and r.is_decoding), key=lambda r: r.arrival):
            while request.status is Status.RUNNING and request.num_computed // self.page_size >= len(request.pages):
                page = self.allocator.allocate(1)
                if page is not None:
                    request.pages += page
                else:
                    self._preempt(max(self.running, key=lambda r: r.arrival))

    def _preempt(self, victim: Request) -> None:
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front, keeping arrival order among earlier preempted requests.
        position = next((i for i, r in enumerate(self.waiting) if r.arrival > victim.arrival), len(self.waiting))
        self.waiting.insert(position, victim)

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.slots[request.slot] = None
            request.slot = None
        if request.pages:
            self.allocator.free(request.pages)
            request.pages = []

    def update_prefill(self, work: PrefillWork, token: int) -> bool:
        """Record a prefill chunk; on the last chunk the sampled token is the next output. Returns
        whether a token was appended."""
        request = work.request
        request.num_computed += len(work.token_ids)
        self._register_full_pages(request)
        if work.is_last_chunk:
            request.output_ids.append(token)
            return True
        return False

    def update_decode(self, request: Request, token: int) -> None:
        request.num_computed += 1
        request.output_ids.append(token)
        self._register_full_pages(request)

    def reset_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use keep theirs); returns how many were evicted."""
        return self.allocator.evict_cached()

    def finish(self, request: Request, reason: str) -> None:
        """Finish (or abort) a request wherever it is; frees its slot and pages."""
        if request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
