"""The scheduler alone (no model, no engine): token-budget packing of ragged steps and the one-step-late
bookkeeping of asynchronous scheduling."""

import math

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.step import StepPlan
from tests.page_checks import assert_pages_released

BUDGET = 64


def make_scheduler(max_num_seqs=20, budget=BUDGET, num_pages=400):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=256, max_num_batched_tokens=budget),
                     CacheConfig(page_size=4, num_pages=num_pages, enable_prefix_caching=False))


def request(name: str, prompt_len: int, max_tokens: int) -> Request:
    prompt = [1] + [(hash(name) + i) % 400 + 3 for i in range(prompt_len - 1)]
    return Request(name, prompt, SamplingParams(temperature=0, max_tokens=max_tokens), seed=0,
                   max_len=prompt_len + max_tokens)


class AsyncLoop:
    """Plans step N+1 before the samples of step N are read, as the engine does; each draw is token 7 and
    is kept as `update_from_output` keeps it (no text, no stop conditions but the length)."""

    def __init__(self, scheduler: Scheduler, *requests: Request):
        self.scheduler = scheduler
        self.requests = {r.key: r for r in requests}
        self.in_flight: StepPlan | None = None
        self.plans: list[StepPlan] = []
        self.outputs: dict[str, list[int]] = {}  # request -> the step numbers it got a token in

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.requests[r.key] = r
            self.scheduler.add(r)

    def request(self, seq) -> Request:
        return self.requests[seq.key]

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan.num_tokens <= self.scheduler.config.max_num_batched_tokens
        self.plans.append(plan)
        done, self.in_flight = self.in_flight, plan
        if done is not None:
            for seq in done.seqs:
                r = self.request(seq)
                if not seq.samples or r.epoch != seq.epoch:
                    continue  # a draw planned before the request finished or was preempted: discarded
                self.scheduler.accept_draws(r, seq, 1)
                r.token_ids.append(7)
                self.outputs.setdefault(r.request_id, []).append(len(self.plans) - 1)
                if len(r.token_ids) >= r.max_len:
                    self.scheduler.finish(r, "length")
                else:
                    self.scheduler.register_full_pages(r)
        return plan


def test_sixteen_prompts_prefill_in_as_few_steps_as_the_budget_allows_while_decodes_run():
    scheduler = make_scheduler()
    loop = AsyncLoop(scheduler)
    decoders = [request(f"d{i}", 5, 200) for i in range(2)]
    loop.add(*decoders)
    loop.step()  # both prompts prefilled in one step; their first tokens are still on the device
    # One output token each: the prefill's own sample finishes them, so the decode load stays at two.
    prompts = [request(f"p{i}", 30, 1) for i in range(16)]
    loop.add(*prompts)
    first = len(loop.plans)
    while any(r.is_prefilling or r.status.value == "waiting" for r in prompts):
        loop.step()
    steps = loop.plans[first:]
    # 16 x 30 prompt tokens next to 2 decode tokens a step: the budget's 62 free tokens, every step full.
    assert len(steps) == math.ceil(16 * 30 / (BUDGET - 2)) == 8
    for plan in steps:
        decodes = [s for s in plan.seqs if not s.is_prefill]
        assert [loop.request(s) for s in decodes] == decoders  # every running decode got its token
        assert all(s.token_ids is None for s in decodes)  # ... fed from the device, not the host
        assert plan.num_tokens == BUDGET or plan is steps[-1]
    assert max(sum(s.is_prefill for s in p.seqs) for p in steps) >= 3  # several prompts share a step
    # Each prompt's chunks are consecutive and cover it exactly; the last one samples.
    for r in prompts:
        chunks = [s for p in steps for s in p.seqs if s.key == r.key]
        assert [c.start for c in chunks] == [sum(c.num_tokens for c in chunks[:i]) for i in range(len(chunks))]
        assert sum(c.num_tokens for c in chunks) == 30
        assert [c.samples for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # The decoders produced a token in every step since they started, prefill or not.
    for r in decoders:
        got = loop.outputs[r.request_id]
        assert got == list(range(got[0], len(loop.plans)))


def test_a_token_sampled_after_a_request_finished_is_discarded():
    scheduler = make_scheduler()
    loop = AsyncLoop(scheduler)
    r = request("a", 6, 50)
    loop.add(r)
    loop.step()  # prefill; first token pending
    loop.step()  # decode planned from the pending token; the first token is read now
    assert r.num_output_tokens == 1 and r.num_pending == 1
    scheduler.finish(r, "stop")  # e.g. a stop string in the first token; a decode is still in flight
    plan = loop.step()
    assert plan.empty and r.num_output_tokens == 1  # the in-flight sample was dropped
    loop.step()
    assert_pages_released(scheduler)


def test_preemption_discards_the_victims_pending_token_and_recomputes_it():
    # 2 slots, 5 usable pages of 4 tokens: the newer request runs out of room and is preempted.
    scheduler = make_scheduler(max_num_seqs=2, budget=16, num_pages=6)
    loop = AsyncLoop(scheduler)
    old, new = request("old", 6, 8), request("new", 6, 8)
    loop.add(old, new)
    for _ in range(40):
        loop.step()
        if old.finished and new.finished:
            break
    assert old.finished and new.finished and scheduler.num_preemptions >= 1
    # After recomputation the victim still has exactly max_tokens outputs, one per sampling index.
    assert old.num_output_tokens == new.num_output_tokens == 8
    sampled = [s.sample_step for p in loop.plans for s in p.seqs if s.key == new.key and s.samples]
    assert sorted(set(sampled)) == list(range(8))  # indices repeat only where a sample was discarded
    loop.step()
    assert_pages_released(scheduler)


def test_the_page_table_changes_of_successive_occupants_of_a_slot_never_mix():
    """The batch builder mirrors each slot's page table from the changes the steps carry. Five successive
    occupants of slot 0 (each sent whole, as a new occupant) get exactly their own pages: the mirror once
    keyed a slot's owner by id(request), which CPython reuses, and a new request inherited stale pages."""
    from jaxserve.execution.batch import BatchBuilder, BatchLayout
    from jaxserve.scheduling.pages import NULL_PAGE
    from jaxserve.scheduling.step import ScheduledSeq

    builder = BatchBuilder(max_num_seqs=1, max_pages=4, page_size=4)
    layout = BatchLayout(tokens=8, seqs=1, max_pages=4, bias_entries=1, scratch_slot=1)
    for i in range(5):
        pages = [10 + i, 100 + i][:1 + i % 2]
        builder.build(StepPlan.of([ScheduledSeq.for_sequence(0, pages, 0, [1, 2, 3, 4, 5][:4 * len(pages)])]),
                      layout)
        assert list(builder.tables[0]) == pages + [NULL_PAGE] * (4 - len(pages))


def test_a_running_sequence_sends_only_the_pages_it_gained():
    scheduler = make_scheduler(max_num_seqs=2)
    loop = AsyncLoop(scheduler)
    r = request("a", 6, 12)
    loop.add(r)
    sent = []
    while not r.finished:
        plan = loop.step()
        sent += [(s.new_in_slot, s.new_pages) for s in plan.seqs if s.key == r.key]
    assert sent[0][0] and len(sent[0][1]) == 2  # the prompt's 2 pages of 4, as a new occupant
    assert all(not fresh for fresh, _ in sent[1:])
    assert [len(pages) for _, pages in sent].count(1) == 3  # positions 8, 12 and 16 each open one more page
    assert sum(len(pages) for _, pages in sent) == 5  # every page once: positions 0..16 are fed
    loop.step()
    assert_pages_released(scheduler)
