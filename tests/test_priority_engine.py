"""Priority scheduling on the real engine (stories260K): a high-priority request that arrives at a full batch
gets its first token within a bounded number of steps, and the low-priority requests it preempts are
recomputed and finish with the same tokens as alone (greedy and seeded). Also: warm-up times every bucket
for the step-time model, the `priority` field is refused under first-come-first-served, and every route
(completions, chat, Responses) hands its `priority` to the engine."""

import pytest

from jaxserve.errors import InvalidParameter
from jaxserve.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def priority_llm(stories_dir):
    from jaxserve import LLM
    # Two slots: two running requests are a full batch. Buckets of their own (2 decodes; prompts of 16).
    return LLM(str(stories_dir), max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(2, 16),
               scheduling_policy="priority")


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)


def test_warmup_timed_every_bucket_for_the_step_time_model(priority_llm):
    scheduler = priority_llm.engine.scheduler
    assert scheduler.step_cost.calibrated
    assert all(scheduler.step_cost.base_seconds(b) > 0 for b in (2, 16))
    # Twice a full batch's decode step (2 sequences), at least its bucket's base whatever a bigger bucket took.
    assert scheduler.step_cost.full_batch_base(2) >= scheduler.step_cost.base_seconds(2)
    assert scheduler.itl_target() == pytest.approx(2 * scheduler.step_cost.full_batch_base(2))
    assert not priority_llm.engine.calibration_due


def test_a_high_priority_arrival_preempts_a_full_batch_and_the_victims_finish_as_alone(priority_llm):
    engine = priority_llm.engine
    prompts = {"low-greedy": "Once upon a time", "low-seeded": "The little dog", "urgent": "Lily saw a"}
    params = {"low-greedy": GREEDY, "low-seeded": SEEDED, "urgent": GREEDY}
    alone = {name: priority_llm.generate(text, params[name])[0].outputs[0].token_ids
             for name, text in prompts.items()}
    preemptions = engine.scheduler.num_preemptions
    tokens = {name: [] for name in prompts}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids

    tokenizer = engine.tokenizer
    for name in ("low-greedy", "low-seeded"):
        engine.add_request(tokenizer.encode(prompts[name]), params[name], request_id=name, priority=1)
    while min(len(tokens["low-greedy"]), len(tokens["low-seeded"])) < 4:
        step()
    engine.add_request(tokenizer.encode(prompts["urgent"]), GREEDY, request_id="urgent", priority=0)
    steps = 0
    while not tokens["urgent"]:
        step()
        steps += 1
    # Planned in the first step after it arrived; its token reaches the host a step later (the asynchronous
    # loop's lag), and one more step may pass while the engine reads a prefill-only step before planning.
    assert steps <= 3
    assert engine.scheduler.num_preemptions == preemptions + 1
    while engine.has_unfinished():
        step()
    assert tokens == alone


def test_priority_is_refused_under_first_come_first_served(stories_llm):
    with pytest.raises(InvalidParameter, match="--scheduling-policy priority") as error:
        stories_llm.generate("Once", SamplingParams(max_tokens=2), priority=[1])
    assert error.value.param == "priority"
    with pytest.raises(ValueError, match="priority has 2 entries for 1 prompts"):
        stories_llm.generate("Once", SamplingParams(max_tokens=2), priority=[0, 0])


@pytest.fixture(scope="module")
def priority_server(stories_dir):
    from jaxserve.engine_args import EngineArgs
    from server.options import ServerOptions
    from tests.server_harness import running_server
    args = EngineArgs(model=str(stories_dir), max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(2, 16),
                      scheduling_policy="priority")
    options = ServerOptions(chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with running_server(args, options=options) as running:
        yield running


def test_every_route_hands_its_priority_to_the_engine(priority_server, monkeypatch):
    import httpx
    base, async_engine = priority_server
    seen = []
    submit = async_engine.engine.submit  # what the server queues: requests the engine has checked

    def spy(request, *args, **kwargs):
        seen.append(request.priority)
        return submit(request, *args, **kwargs)
    monkeypatch.setattr(async_engine.engine, "submit", spy)
    short = {"max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json={**short, "prompt": "Once", "priority": -3},
                      timeout=60).status_code == 200
    assert httpx.post(f"{base}/v1/chat/completions", json={
        **short, "messages": [{"role": "user", "content": "Once"}], "priority": 2}, timeout=60).status_code == 200
    assert httpx.post(f"{base}/v1/responses", json={"input": "Once", "max_output_tokens": 2, "priority": 7},
                      timeout=60).status_code == 200
    assert seen == [-3, 2, 7]
    bad = httpx.post(f"{base}/v1/completions", json={**short, "prompt": "Once", "priority": "high"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
