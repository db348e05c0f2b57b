"""Continuous-batching scheduler: host-only Python, no device arrays. It decides; it never appends tokens.

1. Requests wait in arrival order (`--scheduling-policy priority`: lower `priority` first, ties by
   arrival). One is admitted when a slot is free and the pages for its whole
   prefill (prompt, plus any tokens it generated before a preemption) can be allocated. With prefix
   caching, the longest cached run of full pages of those tokens is shared instead of allocated, and
   prefill starts after it. The hit stops short of the last token: its logits are needed to sample, so
   at least that token is always computed, in a page of its own request. The other choices of an n > 1
   request wait until choice 0 has its prompt prefilled, then start from its prompt pages (shared, one
   reference each) and compute only the rest of the prompt, whose last token each samples itself.
   A request under a LoRA adapter also needs the adapter in a device slot (`lora.acquire`); while every
   slot is in use it waits, and the requests behind it go ahead if they need no adapter: the ones under
   an adapter wait behind it, so a stream of requests for the adapters in the slots cannot keep it from
   a slot forever. Its prefix-cache keys include the adapter, so a prompt under two adapters (or none)
   never shares pages.
2. Each iteration `schedule()` fills one step up to the token budget (`max_num_batched_tokens`, or less
   while step programs still compile): first a span for every decoding sequence (its last token, plus any
   draft tokens to verify; each gets the pages those tokens go to, and when none is free the last
   running request in queue order is preempted and will be recomputed), then prefill chunks of as many
   prefilling sequences as fit, first in queue order. The step is a `StepPlan` of plain `ScheduledSeq`s:
   one ragged batch. Under the priority policy a waiting request may first preempt running requests of
   a lower priority (a larger value) to get a slot and pages. A vision model's image tokens count against an
   encoder budget too, and a chunk holds an image whole where its tokens attend to each other (`images.py`).
3. A step that carries decodes takes only as many prefill tokens as keep it under the inter-token
   latency target, by the step-time model (`step_cost.py`): a long prompt then prefills in chunks
   beside the decodes instead of stalling them. It may always grow to the bucket above the decodes'
   own, so prompts never starve; a step without decodes prefills at full width, and so does one where
   the prompts waiting for their prefill outnumber the decoding sequences by the waiting-served ratio
   (a burst of arrivals: one wide step stalls few streams and starts the burst together).
   vLLM's `long_prefill_token_threshold` and `max_num_partial_prefills` bound the chunks as well.
4. Scheduling runs one step ahead of the host's knowledge (asynchronous scheduling): the step it plans
   is dispatched while the previous one still runs, so a sequence's newest token may still be on the
   device. Such a token is *pending*: the span names the previous step's sample row it comes from, and
   the device feeds it in directly. `num_computed` counts tokens whose K/V the dispatched steps write.
   A sequence under structured outputs (or verifying drafts) is not decoded while a draw is pending:
   its next span depends on the tokens that draw accepts.
5. `update_from_output` (`update.py`) hands each step's draws back through `accept_draws` (bookkeeping
   only: drafts that were rejected are no longer computed) and offers the prefix cache every page that is
   full of known tokens whose K/V a dispatched step writes (`register_full_pages`), prompt and generated
   text alike; so do `finish` and a preemption, for what their request's dispatched steps wrote.
6. `finish` frees a finished or aborted request's slot and pages; pages holding a cached prefix stay
   cached until an allocation needs them (least recently used first). A step still in flight may write
   into freed pages, but every later step runs after it on the device, so their next owner's writes win.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduling.pages import PageAllocator, pages_needed
from jaxserve.scheduling.images import ImageScheduling, image_chunks, page_extras
from jaxserve.scheduling.prefix_cache import PrefixCache, extend_page_keys
from jaxserve.scheduling.request import Request, Status
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from jaxserve.scheduling.step_cost import PrefillCap, StepCostModel


class LoRASlots(Protocol):
    """The device slots of LoRA adapters (`jaxserve/lora/manager.py`'s `LoRAManager`)."""
    def acquire(self, active) -> int | None: ...
    def release(self, slot: int) -> None: ...


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, lora: LoRASlots | None = None,
                 images: ImageScheduling | None = None):
        self.config = scheduler_config
        self.page_size = cache_config.page_size
        self.prefix_cache = PrefixCache() if cache_config.enable_prefix_caching else None
        self.allocator = PageAllocator(cache_config.num_pages, self.prefix_cache)
        self.waiting: deque[Request] = deque()
        self.lora = lora
        self.slots: list[Request | None] = [None] * scheduler_config.max_num_seqs
        self.num_preemptions = 0
        # Positions past its next span a decoding sequence holds pages for: a draft model writes the K/V of
        # its own drafts there (speculative decoding; 0 otherwise).
        self.lookahead = 0
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache (counted at admission)
        self.prefix_cache_hits = 0  # of those, tokens whose K/V came from the cache
        # What steps cost on the device: the engine calibrates it at warm-up and feeds it measured steps.
        self.step_cost = StepCostModel(scheduler_config.token_buckets)
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.images = images  # a vision model's encoder cache and budget; None: text only

    # ---- queries ---------------------------------------------------------------------------------

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    @property
    def num_free_slots(self) -> int:
        return self.slots.count(None)

    def kv_usage(self) -> float:
        return 1 - self.allocator.num_free / self.allocator.num_usable

    def rank(self, request: Request) -> tuple[int, ...]:
        """Queue order: arrival, or (priority, arrival) under the priority policy."""
        return (request.priority, request.arrival) if self.by_priority else (request.arrival,)

    def itl_target(self, context: float = 0.0) -> float | None:
        """Seconds a step that carries decodes should stay under (None: no cap, or nothing measured yet);
        `context`: the decoding sequences' mean context, which a derived target scales with."""
        target = self.config.target_itl
        if target is None:
            return self.step_cost.derived_target(self.config.max_num_seqs, context)
        return target or None

    def waits_for_draws(self) -> bool:
        """Whether a running sequence can be planned only once its pending draw is read: a constrained one
        (its next mask depends on the token) or one verifying drafts (its next span, on how many stand)."""
        return any(r.num_pending and (r.constrained or not r.is_decoding) for r in self.slots if r is not None)

    # ---- planning ----------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.images:
            self.images.acquire(request)
        self._requeue(request)

    def schedule(self, token_limit: int | None = None) -> StepPlan:
        """Plan the next step of at most `token_limit` tokens (default: the configured budget). What it
        plans counts as computed (and drawn) right away."""
        limit = min(token_limit or self.config.max_num_batched_tokens, self.config.max_num_batched_tokens)
        if self.by_priority:  # before anything is planned: a victim's pages must not be in this step
            self._preempt_for_priority()
        preempted = self._reserve_decode_pages()
        seqs: list[ScheduledSeq] = []
        budget = limit
        running = sorted(self.running, key=self.rank)
        for request in running:
            if self._wants_decode(request) and budget > 0:
                seq = self._decode_seq(request, len(seqs), budget)
                seqs.append(seq)
                budget -= seq.num_tokens
        if not preempted:  # pages just freed by a preemption go to the running requests first
            self._admit()
            running = sorted(self.running, key=self.rank)
        cap, capped = None, False  # the cap is made at the first prompt to prefill: most steps only decode
        threshold = self.config.long_prefill_token_threshold or limit
        partial = self.config.max_num_partial_prefills or limit
        rows_left = self.images.rows_per_step if self.images is not None else 0
        for request in running:
            if budget == 0 or partial == 0:
                break
            if request.is_prefilling:
                n = min(request.prefill_target - request.num_computed, budget, threshold)
                if not capped:  # seqs holds the decodes alone yet
                    cap, capped = self._latency_cap(seqs, limit), True
                if cap is not None:
                    n = cap.fit(n, request.num_computed)
                    if n == 0:
                        break
                if request.images and (n := self.images.fit(request, n, rows_left)) == 0:
                    continue  # its next image does not fit this step
                seq = self._prefill_seq(request, n, len(seqs))
                rows_left -= sum(chunk.count for chunk in seq.images)
                seqs.append(seq)
                budget -= seq.num_tokens
                partial -= 1
        return StepPlan(seqs, limit - budget)

    def _latency_cap(self, decodes: list[ScheduledSeq], limit: int) -> PrefillCap | None:
        """The bound on this step's prefill tokens that keeps its decodes under the ITL target (None:
        no bound: no decodes in the step, no target, nothing measured yet, or a burst waits)."""
        if not decodes:
            return None
        decode_kv = sum(seq.start + seq.num_tokens for seq in decodes)
        target = self.itl_target(decode_kv / len(decodes))
        if target is None or not self.step_cost.calibrated or self._burst_waiting(len(decodes)):
            return None
        return PrefillCap(self.step_cost, target, sum(seq.num_tokens for seq in decodes), decode_kv, limit)

    def _burst_waiting(self, decoding: int) -> bool:
        """Whether the admitted sequences still to prefill outnumber the decoding ones by the waiting-served
        ratio: then one wide prefill step, a stall for few streams, starts many together; capped, they
        would trickle in over many steps, each a stall for every stream (TGI's waiting_served_ratio)."""
        ratio = self.config.waiting_served_ratio
        return ratio > 0 and sum(r.is_prefilling for r in self.running) >= ratio * decoding

    @staticmethod
    def _wants_decode(request: Request) -> bool:
        # A sequence at its length limit only waits for its pending token, which finishes it. A constrained
        # one waits for its pending token too: its next draw's mask depends on it.
        # A prompt's last token is a decode's shape too, but it goes through `_prefill_seq`, which forks
        # the request's other choices once its prompt is in.
        return (request.is_decoding and not request.is_prefilling and request.num_tokens < request.max_len
                and not (request.constrained and request.num_pending))

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The draft tokens to verify after the request's last token: as many as the budget, the pages
        reserved and its length limit allow (a proposer fills `draft_token_ids`; none does yet)."""
        if not request.draft_token_ids or request.num_pending or request.constrained:
            return []
        room = min(budget - 1, request.max_len - request.num_tokens - 1,
                   len(request.pages) * self.page_size - request.num_computed - 1)
        return request.draft_token_ids[:max(room, 0)]

    def _decode_seq(self, request: Request, row: int, budget: int) -> ScheduledSeq:
        pending = request.num_pending > 0
        drafts = self._drafts(request, budget)
        tokens = None if pending else tuple(request.token_ids[-1:]) + tuple(drafts)
        seq = self._seq(request, request.num_computed, 1 + len(drafts), tokens,
                        prev_row=request.pending_row if pending else -1,
                        sample_step=request.num_tokens - request.num_prompt_tokens, num_draft_tokens=len(drafts))
        request.draft_token_ids = []
        request.num_computed += seq.num_tokens
        self._mark_drawn(request, row)
        return seq

    def _prefill_seq(self, request: Request, n: int, row: int) -> ScheduledSeq:
        start = request.num_computed
        last = start + n == request.prefill_target
        targets = None
        if request.scores_prompt:  # each row scores the prompt token after it
            targets = tuple(request.token_ids[start + 1:min(start + n + 1, request.num_prompt_tokens)])
        seq = self._seq(request, start, n, tuple(request.token_ids[start:start + n]), is_prefill=True,
                        first_chunk=start == request.admitted_at, prompt_targets=targets,
                        sample_step=request.num_tokens - request.num_prompt_tokens if last else -1,
                        images=image_chunks(request.images, start, n))
        request.num_computed += n
        if last:
            self._mark_drawn(request, row)
            if request.forks:
                self._fork(request)
        return seq

    def _seq(self, request: Request, start: int, n: int, tokens: tuple[int, ...] | None, *, sample_step: int,
             prev_row: int = -1, num_draft_tokens: int = 0, is_prefill: bool = False, first_chunk: bool = False,
             prompt_targets: tuple[int, ...] | None = None, images: tuple = ()) -> ScheduledSeq:
        new_in_slot = request.num_pages_sent == 0  # its first span since (re)admission: a fresh page-table row
        new_pages = tuple(request.pages[request.num_pages_sent:])
        request.num_pages_sent = len(request.pages)
        params = request.params
        suppress = request.suppress_ids if request.suppress_ids and 0 <= sample_step < params.min_tokens else ()
        return ScheduledSeq(key=request.key, epoch=request.epoch, slot=request.slot, start=start, num_tokens=n,
                            token_ids=tokens, prev_row=prev_row, new_pages=new_pages, new_in_slot=new_in_slot,
                            first_chunk=first_chunk, is_prefill=is_prefill, sample_step=sample_step,
                            num_draft_tokens=num_draft_tokens, constrained=request.constrained,
                            num_prompt_tokens=request.num_prompt_tokens, params=params,
                            seed_words=request.seed_words, bias=request.bias, suppress_ids=suppress,
                            prompt_targets=prompt_targets, lora_slot=request.lora_slot, images=images,
                            mrope=request.mrope,
                            head_setting=request.head_state.setting if request.head_state is not None else 0)

    @staticmethod
    def _mark_drawn(request: Request, row: int) -> None:
        request.num_pending += 1
        request.pending_row = row

    def _admission_needs(self, request: Request) -> tuple[list[int], int, int]:
        """What admitting `request` takes: (prefix pages it shares, fresh pages, pages to allocate: the
        fresh ones plus shared ones that sit idle in the cache, which count as free until acquired)."""
        forked = bool(request.shared_pages)  # its prompt's pages come from choice 0, already held
        hits = request.shared_pages if forked else self._cached_prefix(request, len(request.token_ids))
        fresh = pages_needed(len(request.token_ids), self.page_size) - len(hits)
        idle_hits = sum(self.prefix_cache.is_idle(p) for p in hits) if hits and not forked else 0
        return hits, fresh, fresh + idle_hits

    def _admit(self) -> None:
        position = 0  # requests before it wait for their LoRA adapter's slot
        while position < len(self.waiting) and None in self.slots:
            request = self.waiting[position]
            if position and request.lora is not None:  # behind one that waits for a slot: in order
                position += 1
                continue
            target = len(request.token_ids)
            forked = bool(request.shared_pages)
            hits, fresh, to_allocate = self._admission_needs(request)
            if not self.allocator.can_allocate(to_allocate):
                return  # wait for pages: strict queue order, so big prompts are not starved
            if request.lora is not None:
                lora_slot = self.lora.acquire(request.lora)
                if lora_slot is None:  # every adapter slot is in use: wait, let the others go ahead
                    position += 1
                    continue
                request.lora_slot = lora_slot
            if not forked:
                self.allocator.acquire(hits)
            pages = hits + self.allocator.allocate(fresh)
            del self.waiting[position]
            request.shared_pages = []
            request.status = Status.RUNNING
            request.slot = self.slots.index(None)
            request.pages, request.num_pages_sent = pages, 0
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
        if self.prefix_cache is None or request.needs_every_token:
            return []
        # At most target - 1 tokens, in whole pages: the last token is computed for its logits, and it
        # and everything after it land in pages this request owns alone.
        usable = (target - 1) // self.page_size
        extend_page_keys(request.page_keys, request.token_ids, self.page_size, usable, _extra_keys(request),
                         page_extras(request.images, self.page_size))
        return self.prefix_cache.lookup(request.page_keys[:usable])

    def register_full_pages(self, request: Request) -> None:
        """Offer the prefix cache every page that is full of known tokens whose K/V a dispatched step
        writes. Later readers run after that step on the device, so they see the K/V."""
        if self.prefix_cache is None or request.status is not Status.RUNNING:
            return
        full = min(request.num_computed, len(request.token_ids)) // self.page_size
        if full <= request.num_registered:
            return
        keys = extend_page_keys(request.page_keys, request.token_ids, self.page_size, full, _extra_keys(request),
                                page_extras(request.images, self.page_size))
        for i in range(request.num_registered, full):
            self.prefix_cache.register(request.pages[i], keys[i])
        request.num_registered = full

    def _reserve_decode_pages(self) -> bool:
        """Give every decoding sequence the pages its next span goes to (its token and any drafts),
        preempting if need be. Returns whether anything was preempted."""
        preempted = False
        for request in sorted((r for r in self.slots if r is not None and self._wants_decode(r)),
                              key=lambda r: r.arrival):
            span = 1 + len(request.draft_token_ids) if not request.num_pending else 1
            end = min(request.num_computed + span + self.lookahead, request.max_len)
            while request.status is Status.RUNNING and pages_needed(end, self.page_size) > len(request.pages):
                page = self.allocator.allocate(1)
                if page is not None:
                    request.pages += page
                elif pages_needed(request.num_computed + 1, self.page_size) <= len(request.pages):
                    break  # room for its own token: the drafts wait
                else:
                    self._preempt(max(self.running, key=self.rank))
                    preempted = True
        return preempted

    def _preempt_for_priority(self) -> None:
        """Make room for the first waiting request by preempting running requests of a lower priority
        (larger value), lowest first, if that frees enough; they are recomputed once readmitted."""
        head = self.waiting[0] if self.waiting else None
        if head is None:
            return
        victims = sorted((r for r in self.running if r.priority > head.priority), key=self.rank, reverse=True)
        if not victims:
            return
        _, _, to_allocate = self._admission_needs(head)
        slots_short = 0 if None in self.slots else 1
        freeable = sum(self.allocator.refcount(p) == 1 for r in victims for p in r.pages)
        if to_allocate > self.allocator.num_free + freeable:
            return  # even every victim's pages would not do: preempt nobody
        for victim in victims:
            if slots_short <= 0 and self.allocator.can_allocate(to_allocate):
                break
            self._preempt(victim)
            slots_short -= 1

    def _preempt(self, victim: Request) -> None:
        self.register_full_pages(victim)  # what its dispatched steps wrote saves its recomputation
        self._release(victim)
        victim.status = Status.WAITING
        victim.num_computed = 0
        victim.num_pending = 0  # its in-flight draw is discarded and drawn again after recomputation
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(victim)

    def _requeue(self, request: Request) -> None:
        """Into the queue at its place in queue order (a preempted request: ahead of later arrivals)."""
        rank = self.rank(request)
        if not self.waiting or self.rank(self.waiting[-1]) < rank:
            self.waiting.append(request)  # the common case: a new arrival goes last
            return
        position = next((i for i, r in enumerate(self.waiting) if self.rank(r) > rank), len(self.waiting))
        self.waiting.insert(position, request)

    def _release(self, request: Request) -> None:
        request.epoch += 1
        request.pending_row = -1
        request.num_pages_sent = 0
        if request.shared_pages:  # a forked choice that never ran
            self.allocator.free(request.shared_pages)
            request.shared_pages = []
        if request.slot is not None:
            self.slots[request.slot] = None
            request.slot = None
        if request.lora_slot:
            self.lora.release(request.lora_slot)
            request.lora_slot = 0
        if request.pages:
            self.allocator.free(request.pages)
            request.pages = []

    # ---- results -------------------------------------------------------------------------------------

    def accept_draws(self, request: Request, seq: ScheduledSeq, accepted: int) -> None:
        """A step's draws for `seq` reached the host and `accepted` of its tokens stand (the caller appends
        them). Drafts after the first rejected one were computed for nothing: the next span recomputes
        from there."""
        request.num_pending -= 1
        request.num_computed -= seq.num_draft_tokens - max(accepted - 1, 0)

    def reset_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use keep theirs); returns how many were evicted. The encoder
        cache drops the rows of every image no request needs."""
        if self.images is not None:
            self.images.cache.clear_idle()
        return self.allocator.evict_cached()

    def finish(self, request: Request, reason: str) -> None:
        """Finish (or abort) a request wherever it is; frees its slot and pages. Choices not forked yet are
        the caller's to finish."""
        if request.status is Status.WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.forks = []
        self.register_full_pages(request)
        self._release(request)
        if request.images:
            self.images.release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.num_pending = 0


def _extra_keys(request: Request) -> tuple:
    salt = request.cache_salt
    keys = ("salt", salt) if salt is not None else ()
    return keys + request.lora.key if request.lora is not None else keys
