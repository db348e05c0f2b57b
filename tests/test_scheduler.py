"""The scheduler alone (no model, no engine): token-budget packing of ragged steps and the one-step-late
bookkeeping of asynchronous scheduling."""

import math

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.scheduler import Request, Scheduler, StepPlan
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
    """Plans step N+1 before the samples of step N are read, as the engine does."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.in_flight: StepPlan | None = None
        self.plans: list[StepPlan] = []
        self.outputs: dict[str, list[int]] = {}  # request -> the step numbers it got a token in

    def step(self) -> StepPlan:
        plan = self.scheduler.schedule()
        assert plan.num_tokens <= self.scheduler.config.max_num_batched_tokens
        self.plans.append(plan)
        done, self.in_flight = self.in_flight, plan
        if done is not None:
            for chunk in done.chunks:
                if chunk.samples and self.scheduler.accept_token(chunk, 7):
                    r = chunk.request
                    self.outputs.setdefault(r.request_id, []).append(len(self.plans) - 1)
                    if len(r.token_ids) >= r.max_len:
                        self.scheduler.finish(r, "length")
        return plan


def test_sixteen_prompts_prefill_in_as_few_steps_as_the_budget_allows_while_decodes_run():
    scheduler = make_scheduler()
    loop = AsyncLoop(scheduler)
    decoders = [request(f"d{i}", 5, 200) for i in range(2)]
    for r in decoders:
        scheduler.add(r)
    loop.step()  # both prompts prefilled in one step; their first tokens are still on the device
    # One output token each: the prefill's own sample finishes them, so the decode load stays at two.
    prompts = [request(f"p{i}", 30, 1) for i in range(16)]
    for r in prompts:
        scheduler.add(r)
    first = len(loop.plans)
    while any(r.is_prefilling or r.status.value == "waiting" for r in prompts):
        loop.step()
    steps = loop.plans[first:]
    # 16 x 30 prompt tokens next to 2 decode tokens a step: the budget's 62 free tokens, every step full.
    assert len(steps) == math.ceil(16 * 30 / (BUDGET - 2)) == 8
    for plan in steps:
        decodes = [c for c in plan.chunks if not c.is_prefill]
        assert [c.request for c in decodes] == decoders  # every running decode got its token
        assert all(c.token_ids is None for c in decodes)  # ... fed from the device, not the host
        assert plan.num_tokens == BUDGET or plan is steps[-1]
    assert max(sum(c.is_prefill for c in p.chunks) for p in steps) >= 3  # several prompts share a step
    # Each prompt's chunks are consecutive and cover it exactly; the last one samples.
    for r in prompts:
        chunks = [c for p in steps for c in p.chunks if c.request is r]
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
    scheduler.add(r)
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
    scheduler.add(old)
    scheduler.add(new)
    for _ in range(40):
        loop.step()
        if old.finished and new.finished:
            break
    assert old.finished and new.finished and scheduler.num_preemptions >= 1
    # After recomputation the victim still has exactly max_tokens outputs, one per sampling index.
    assert old.num_output_tokens == new.num_output_tokens == 8
    sampled = [c.sample_step for p in loop.plans for c in p.chunks if c.request is new and c.samples]
    assert sorted(set(sampled)) == list(range(8))  # indices repeat only where a sample was discarded
    loop.step()
    assert_pages_released(scheduler)


def test_a_slot_s_next_occupant_never_inherits_the_page_mirror_of_the_last(monkeypatch):
    """Regression: the batch builder once keyed a slot's page mirror by id(request). CPython hands a dead
    object's id to the next one of its size, so a new request admitted to the slot inherited the previous
    occupant's pages and attended over (and wrote into) the wrong KV pages. Reuse of an address happens
    by chance; here every object gets the same id, so the hazard is certain."""
    import jaxserve.execution.batch
    from jaxserve.execution.batch import BatchBuilder, BatchLayout
    from jaxserve.scheduling.pages import NULL_PAGE
    from jaxserve.scheduling.scheduler import ScheduledChunk

    monkeypatch.setattr(jaxserve.execution.batch, "id", lambda obj: 1, raising=False)
    builder = BatchBuilder(max_num_seqs=1, max_pages=4, page_size=4)
    layout = BatchLayout(tokens=8, seqs=1, max_pages=4, bias_entries=1)
    for i in range(5):  # five successive occupants of slot 0, each with its own pages
        pages = [10 + i, 100 + i]
        builder.build([ScheduledChunk.for_sequence(0, pages, 0, [1, 2, 3, 4, 5])], layout)
        assert list(builder.tables[0]) == pages + [NULL_PAGE] * 2
