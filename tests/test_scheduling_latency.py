"""The scheduler's latency controls without a model: the step-time model, the inter-token-latency cap on
the prefill share of a step, vLLM's chunking knobs, and priority scheduling with preemption. A fake device
answers every draw with token 7 and "takes" a scripted time per step (a base per token bucket plus a KV
term), which the tests feed back to the step-time model as the engine does."""

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.scheduling.request import Request
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.step import StepPlan
from jaxserve.scheduling.step_cost import StepCostModel, kv_tokens_read
from tests.page_checks import assert_pages_released
from tests.test_scheduler import AsyncLoop, request

BUDGET = 512


def scripted_seconds(bucket: int, kv_tokens: int) -> float:
    """The fake device: 2 ms a step, 0.1 ms per padded token, 1 us per KV token read."""
    return 2e-3 + 1e-4 * bucket + 1e-6 * kv_tokens


def make_scheduler(target_itl: float | None, policy: str = "fcfs", max_num_seqs: int = 8, num_pages: int = 600,
                   **knobs) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=1024, max_num_batched_tokens=BUDGET,
                                          scheduling_policy=policy, target_itl=target_itl, **knobs),
                          CacheConfig(page_size=4, num_pages=num_pages, enable_prefix_caching=False))
    return scheduler


def light_seconds(bucket: int, kv_tokens: int) -> float:
    """A small model's fake device: a step's fixed cost dwarfs its tokens' (stories260K on CPU: 1.4 ms for
    4 tokens, 2.5 ms for 64)."""
    return 2e-3 + 2e-5 * bucket


def calibrate(scheduler: Scheduler, device=scripted_seconds) -> None:
    """What warm-up does: time an idle step (no KV) of every bucket, twice."""
    for bucket in scheduler.config.token_buckets:
        for _ in range(2):
            scheduler.step_cost.observe(bucket, 0, device(bucket, 0))


class TimedLoop(AsyncLoop):
    """The async loop, each step "run" on the fake device: its scripted time is recorded and fed back."""

    def __init__(self, scheduler: Scheduler, *requests: Request, device=scripted_seconds):
        super().__init__(scheduler, *requests)
        self.seconds: list[float] = []
        self.device = device

    def step(self) -> StepPlan:
        plan = super().step()
        bucket = self.scheduler.step_cost.bucket_for(plan.num_tokens)
        seconds = self.device(bucket, kv_tokens_read(plan)) if not plan.empty else 0.0
        self.seconds.append(seconds)
        if not plan.empty:
            self.scheduler.step_cost.observe(bucket, kv_tokens_read(plan), seconds)
        return plan


def run_long_prompt_beside_decodes(target_itl: float | None, **knobs):
    """Six sequences decode; then a 1000-token prompt arrives. Returns the loop, the prompt and the index
    of the first step planned after it arrived."""
    scheduler = make_scheduler(target_itl, **knobs)
    calibrate(scheduler)
    loop = TimedLoop(scheduler)
    decoders = [request(f"d{i}", 8, 300) for i in range(6)]
    loop.add(*decoders)
    for _ in range(3):
        loop.step()
    long_prompt = request("long", 1000, 4)
    loop.add(long_prompt)
    first = len(loop.plans)
    while long_prompt.is_prefilling or long_prompt.status.value == "waiting":
        loop.step()
        assert len(loop.plans) < first + 100, "the long prompt never finished prefilling"
    return loop, long_prompt, decoders, first


def test_decode_steps_stay_under_the_target_while_a_long_prompt_prefills():
    target = 0.02
    loop, long_prompt, decoders, first = run_long_prompt_beside_decodes(target)
    steps = list(zip(loop.plans[first:], loop.seconds[first:]))
    with_decodes = [(plan, s) for plan, s in steps if not plan.prefill_only]
    assert with_decodes and all(s <= target for _, s in with_decodes), [s for _, s in with_decodes]
    # The prompt is chunked beside the decodes, every chunk as big as the target allows: no step starves it.
    chunks = [seq.num_tokens for plan, _ in steps for seq in plan.seqs if seq.key == long_prompt.key]
    assert sum(chunks) == 1000 and len(chunks) >= 1000 // BUDGET + 2
    assert min(chunks[:-1]) >= 64
    assert all(r.num_output_tokens > 0 and not r.is_prefilling for r in decoders)
    # It then decodes beside the others.
    for _ in range(3):
        loop.step()
    assert long_prompt.num_output_tokens >= 1


def test_without_a_target_the_prefill_takes_the_whole_budget_and_stalls_the_decodes():
    target = 0.02
    loop, long_prompt, _, first = run_long_prompt_beside_decodes(0)  # 0: no cap
    stalled = [s for plan, s in zip(loop.plans[first:], loop.seconds[first:]) if not plan.prefill_only]
    assert max(stalled) > 2 * target  # what the cap above prevents
    assert loop.plans[first].num_tokens == BUDGET


def test_steps_without_decodes_prefill_at_full_width():
    scheduler = make_scheduler(0.005)  # a target no prefill chunk fits
    calibrate(scheduler)
    loop = TimedLoop(scheduler)
    loop.add(request("alone", 1000, 2))
    assert loop.step().num_tokens == BUDGET


@pytest.mark.parametrize("ratio", [1.2, 0])
def test_a_burst_of_arrivals_beside_few_decodes_prefills_at_full_width_and_starts_together(ratio):
    """One sequence decodes when six 80-token prompts arrive at once. Past the waiting-served ratio the next
    step prefills all six (a single stall of the one stream), and they then decode in the same steps; with
    the ratio off, the cap lets them in a chunk at a time, and every such step stalls the running streams."""
    scheduler = make_scheduler(0.02, waiting_served_ratio=ratio)
    calibrate(scheduler)
    loop = TimedLoop(scheduler)
    loop.add(request("running", 8, 200))
    for _ in range(3):
        loop.step()
    burst = [request(f"b{i}", 80, 20) for i in range(6)]
    loop.add(*burst)
    plan = loop.step()
    prefilled = sum(seq.num_tokens for seq in plan.seqs if seq.is_prefill)
    if ratio:
        assert prefilled == 6 * 80 and loop.seconds[-1] > 0.02  # past the target, once
        for _ in range(3):
            loop.step()
        first_tokens = {min(loop.outputs[r.request_id]) for r in burst}
        assert len(first_tokens) == 1, "the burst's sequences did not start decoding together"
    else:
        assert 0 < prefilled < 6 * 80 and loop.seconds[-1] <= 0.02


def test_a_lone_arrival_beside_many_decodes_stays_under_the_cap_whatever_the_ratio():
    scheduler = make_scheduler(0.02, waiting_served_ratio=1.2)
    calibrate(scheduler)
    loop = TimedLoop(scheduler)
    loop.add(*(request(f"d{i}", 8, 200) for i in range(3)))
    for _ in range(3):
        loop.step()
    loop.add(request("late", 400, 4))
    loop.step()
    assert loop.seconds[-1] <= 0.02 and loop.plans[-1].num_tokens < 3 + 400


def test_the_derived_target_is_twice_a_full_batch_decode_step():
    scheduler = make_scheduler(None)
    assert scheduler.itl_target() is None  # nothing measured yet: no cap
    calibrate(scheduler)
    assert scheduler.itl_target() == pytest.approx(2 * scripted_seconds(8, 0))


def short_prompt_beside_three_decodes(scheduler: Scheduler, device) -> int:
    """Three sequences decode (served on `device`) when a 64-token prompt arrives: the prompt tokens of the
    step that admits it."""
    loop = TimedLoop(scheduler, device=device)
    loop.add(*(request(f"d{i}", 300, 200) for i in range(3)))
    for _ in range(30):
        loop.step()
    short = request("short", 64, 4)
    loop.add(short)
    plan = loop.step()
    return sum(seq.num_tokens for seq in plan.seqs if seq.key == short.key)


def test_a_short_prompt_beside_a_few_decodes_is_prefilled_whole_after_served_steps_slowed():
    # Served steps run 1.5x their warm-up time (the HTTP thread shares the cores); the full batch's bucket
    # (16) is never served at 3 streams, so its base is still warm-up's. A target from it alone stood
    # below the served prefill step's prediction, and the prompt went in 5 tokens a step.
    scheduler = make_scheduler(None, max_num_seqs=16)
    calibrate(scheduler, light_seconds)
    assert light_seconds(64, 0) < scheduler.itl_target()  # at warm-up, such a step is well under it
    served = lambda bucket, kv: 1.5 * light_seconds(bucket, kv)
    for _ in range(10):  # prefill steps served before
        scheduler.step_cost.observe(64, 0, served(64, 0))
    assert short_prompt_beside_three_decodes(scheduler, served) == 64


def test_the_derived_target_counts_the_kv_a_full_batch_reads_at_the_decodes_context():
    # Served steps whose time grows with the KV read (the step-time model fits the slope online): a
    # target without the KV term stood below the prediction of any step with decodes at long contexts.
    scheduler = make_scheduler(None, max_num_seqs=16)
    calibrate(scheduler, light_seconds)
    served = lambda bucket, kv: light_seconds(bucket, kv) + 5e-6 * kv
    assert short_prompt_beside_three_decodes(scheduler, served) == 64
    model = scheduler.step_cost
    assert model.per_kv_token == pytest.approx(5e-6, rel=0.05)
    assert scheduler.itl_target(300) == pytest.approx(
        2 * (model.full_batch_base(16) + model.per_kv_token * 16 * 300), rel=1e-6)


def test_long_prefill_token_threshold_and_max_num_partial_prefills_bound_the_chunks():
    scheduler = make_scheduler(0, long_prefill_token_threshold=100, max_num_partial_prefills=2)
    loop = AsyncLoop(scheduler)
    loop.add(*(request(f"p{i}", 300, 2) for i in range(3)))
    plan = loop.step()
    assert [seq.num_tokens for seq in plan.seqs] == [100, 100]


def test_the_step_time_model_learns_bucket_times_and_the_kv_slope_online():
    model = StepCostModel((8, 16, 32, 64))
    assert model.predict(10, 0) is None
    for bucket in (8, 32):
        model.observe(bucket, 0, scripted_seconds(bucket, 0))
    # Unmeasured buckets are interpolated between measured ones, and extrapolated in proportion above.
    assert model.predict(16, 0) == pytest.approx(scripted_seconds(8, 0) + (8 / 24) * (
        scripted_seconds(32, 0) - scripted_seconds(8, 0)))
    assert model.predict(64, 0) == pytest.approx(2 * scripted_seconds(32, 0))
    for kv in range(0, 5000, 250):  # served steps: contexts grow
        for bucket in (8, 16, 32, 64):
            model.observe(bucket, kv, scripted_seconds(bucket, kv))
    assert model.per_kv_token == pytest.approx(1e-6, rel=0.05)
    for bucket in (8, 16, 32, 64):
        assert model.predict(bucket, 3000) == pytest.approx(scripted_seconds(bucket, 3000), rel=0.02)
    # A one-off stall (a GC pause) moves the estimate by a bounded amount only.
    before = model.predict(16, 0)
    model.observe(16, 0, 10.0)
    assert model.predict(16, 0) < 1.2 * before


# ---- priorities ------------------------------------------------------------------------------------------


def prioritized(name: str, prompt_len: int, max_tokens: int, priority: int) -> Request:
    r = request(name, prompt_len, max_tokens)
    r.priority = priority
    return r


def test_priority_policy_orders_the_queue_by_priority_then_arrival():
    scheduler = make_scheduler(0, policy="priority", max_num_seqs=1)
    loop = AsyncLoop(scheduler)
    late_urgent = [prioritized("a", 5, 1, 3), prioritized("b", 5, 1, 1), prioritized("c", 5, 1, 1)]
    loop.add(*late_urgent)
    order = []
    while scheduler.waiting or scheduler.running or loop.in_flight is not None and not loop.in_flight.empty:
        plan = loop.step()
        order += [loop.request(seq).request_id for seq in plan.seqs if seq.first_chunk]
    assert order == ["b", "c", "a"]


def test_under_fcfs_priorities_do_not_reorder():
    scheduler = make_scheduler(0, max_num_seqs=1)
    loop = AsyncLoop(scheduler)
    loop.add(prioritized("a", 5, 1, 3), prioritized("b", 5, 1, 1))
    assert [loop.request(seq).request_id for seq in loop.step().seqs] == ["a"]


def test_a_high_priority_arrival_preempts_a_full_batch_within_a_bounded_number_of_steps():
    scheduler = make_scheduler(0, policy="priority", max_num_seqs=4, num_pages=200)
    loop = AsyncLoop(scheduler)
    low = [prioritized(f"low{i}", 20, 40, 5) for i in range(4)]
    loop.add(*low)
    for _ in range(5):
        loop.step()
    assert all(r.num_output_tokens > 0 for r in low)
    urgent = prioritized("urgent", 20, 10, 0)
    loop.add(urgent)
    arrived = len(loop.plans)
    for _ in range(3):
        loop.step()
    # Planned (its prompt, which draws its first token) in the first step after it arrived; that token
    # reaches the host one step later, the asynchronous loop's fixed lag.
    assert loop.outputs["urgent"][0] - arrived <= 1
    assert scheduler.num_preemptions == 1 and max(r.num_preemptions for r in low) == 1
    while any(not r.finished for r in [*low, urgent]):
        loop.step()
        assert len(loop.plans) < 500
    # Every preempted request was recomputed and completed its whole output.
    assert all(r.num_output_tokens == 40 for r in low) and urgent.num_output_tokens == 10
    assert_pages_released(scheduler)


def test_equal_or_lower_priority_arrivals_never_preempt():
    scheduler = make_scheduler(0, policy="priority", max_num_seqs=2)
    loop = AsyncLoop(scheduler)
    loop.add(prioritized("x", 5, 30, 1), prioritized("y", 5, 30, 1))
    loop.step()
    loop.add(prioritized("same", 5, 3, 1), prioritized("lower", 5, 3, 2))
    for _ in range(10):
        loop.step()
    assert scheduler.num_preemptions == 0


# ---- options -----------------------------------------------------------------------------------------------


def test_scheduling_flags_reach_the_engine_args_and_bad_values_are_refused():
    import argparse

    from jaxserve.engine_args import EngineArgs
    from jaxserve.entrypoints.args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(
        ["--scheduling-policy", "priority", "--target-itl-ms", "40", "--long-prefill-token-threshold", "256",
         "--max-num-partial-prefills", "2", "--waiting-served-ratio", "0.5"]))
    assert (args.scheduling_policy, args.target_itl_ms, args.long_prefill_token_threshold,
            args.max_num_partial_prefills, args.waiting_served_ratio) == ("priority", 40, 256, 2, 0.5)
    for bad in ({"scheduling_policy": "lifo"}, {"target_itl_ms": -1}, {"long_prefill_token_threshold": -5},
                {"max_num_partial_prefills": 0}, {"waiting_served_ratio": -1},
                {"waiting_served_ratio": float("nan")}):
        with pytest.raises(ValueError):
            EngineArgs(**bad)


def test_a_bucket_slowed_by_a_busy_machine_is_capped_by_the_faster_buckets_above_it():
    model = StepCostModel((8, 16, 32, 64))
    for bucket, seconds in ((8, 0.002), (16, 0.019), (32, 0.003), (64, 0.005)):
        model.observe(bucket, 0, seconds)
    assert [model.base_seconds(b) for b in (8, 16, 32, 64)] == pytest.approx([0.002, 0.003, 0.003, 0.005])


def test_a_steps_device_time_is_told_only_where_the_host_waited_for_both_ends():
    from jaxserve.scheduling.step_cost import StepClock

    clock = StepClock()
    # Waited for: it ran from its launch (nothing before it) to its samples.
    assert clock.device_seconds(launched_at=0.0, done_at=0.010, waited=True) == pytest.approx(0.010)
    # Launched at 0.005, while the step before still ran: it started when that one ended, at 0.010.
    assert clock.device_seconds(launched_at=0.005, done_at=0.022, waited=True) == pytest.approx(0.012)
    # Its samples were there when the host looked: no telling when it ended...
    assert clock.device_seconds(launched_at=0.015, done_at=0.040, waited=False) is None
    # ...nor when the next one, launched before that, started.
    assert clock.device_seconds(launched_at=0.030, done_at=0.050, waited=True) is None
    # A step launched after the one before ended (the device idled) runs from its launch.
    assert clock.device_seconds(launched_at=0.060, done_at=0.070, waited=True) == pytest.approx(0.010)


def test_a_higher_priority_arrival_preempts_nobody_when_the_victims_pages_would_not_do():
    scheduler = make_scheduler(0, policy="priority", max_num_seqs=4, num_pages=40)  # 39 pages of 4 tokens
    loop = AsyncLoop(scheduler)
    low = prioritized("low", 20, 40, 5)  # holds 5-6 pages
    loop.add(low)
    for _ in range(3):
        loop.step()
    huge = prioritized("huge", 200, 2, 0)  # needs 50 pages: more than the cache holds
    loop.add(huge)
    for _ in range(3):
        loop.step()
    assert scheduler.num_preemptions == 0 and low.num_output_tokens >= 3


def test_the_async_engine_times_programs_compiled_in_the_background_when_idle_one_at_a_time():
    import threading

    from jaxserve.entrypoints.async_engine import AsyncEngine

    class IdleEngine:
        """An engine with no requests whose background compilation finished with three buckets untimed."""
        def __init__(self):
            self.untimed, self.calls, self.done = 3, [], threading.Event()
            self.runner = type("Runner", (), {"stop_warmup": lambda self, timeout=None: None})()

        def warmup(self, background=False):
            return 0.0

        def has_unfinished(self):
            return False

        @property
        def calibration_due(self):
            return self.untimed > 0

        def calibrate_step_cost(self, max_buckets=None):
            self.calls.append(max_buckets)
            self.untimed -= max_buckets
            if not self.untimed:
                self.done.set()

        def release(self):
            pass

    engine = IdleEngine()
    loop = AsyncEngine(engine=engine)
    loop.start()
    try:
        assert engine.done.wait(10)
    finally:
        loop.shutdown(timeout=5)
    assert engine.calls == [1, 1, 1]


def test_a_prompt_beside_decodes_always_gets_up_to_the_next_bucket_even_when_nothing_fits_the_target():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=256, max_num_batched_tokens=16,
                                          token_buckets=(2, 16), target_itl=1e-9),
                          CacheConfig(page_size=4, num_pages=100, enable_prefix_caching=False))
    for bucket in (2, 16):
        scheduler.step_cost.observe(bucket, 0, scripted_seconds(bucket, 0))
    loop = AsyncLoop(scheduler)
    loop.add(request("decoding", 4, 50))
    loop.step()
    loop.step()
    loop.add(request("prompt", 12, 2))
    plan = loop.step()
    # One decode would leave a single padding token in bucket 2; the step grows to bucket 16 instead.
    assert [seq.num_tokens for seq in plan.seqs] == [1, 12]
