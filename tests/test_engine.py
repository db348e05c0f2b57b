"""Engine and scheduler behaviour driven by a scripted fake runner (no model math).

Each request's seed names its script: the fake runner answers the i-th sampled token of a request with
`scripts[seed][i]`, so tests control exactly what "the model" says and when.
"""

import threading

import numpy as np
import pytest

from jaxserve import Engine, EngineArgs, SamplingParams
from jaxserve.scheduling.pages import pages_needed
from jaxserve.execution.compiler import StepCompiler
from jaxserve.scheduling.step import SampledTokens, StepPlan
from tests.page_checks import assert_pages_released


class FakeLaunched:
    bucket, launched_at, done_at, waited = 0, 0.0, None, False  # no step times to learn from

    def __init__(self, step, samples):
        self.step, self.samples = step, samples

    def read(self):
        return SampledTokens.one_per_row(self.samples, self.step)


class FakeRunner:
    """Stands in for the model runner: answers each sampled span from the scripts, and checks the
    asynchronous contract on every step (pages present, the page-table changes a step carries rebuild each
    request's pages, writes only into unshared pages, a token taken from the device names a row of the
    previous step that sampled for the same request)."""

    def __init__(self, scripts, requests, allocator=None, page_size=4):
        self.scripts = scripts
        self.requests = requests  # the engine's live requests, by key
        self.allocator = allocator  # when given, every write is checked to land in an unshared page
        self.page_size = page_size
        self.steps = []  # per step: [(seed, start, num_tokens, is_prefill)]
        self.fed = {}  # request id -> {position: token id the model was given there}
        self.tables = {}  # slot -> the pages the steps told it about
        self._last = None  # (plan, samples) of the previous step

    def _check_writable(self, pages, positions):
        """The prefix-cache invariant: a step writes only pages its request holds alone, uncached."""
        if self.allocator is None:
            return
        for page in {pages[p // self.page_size] for p in positions}:
            assert self.allocator.refcount(page) == 1, f"write into shared page {page}"
            cache = self.allocator.prefix_cache
            assert cache is None or not cache.holds(page), f"write into cached page {page}"

    def _token(self, seed, step):
        script = self.scripts[seed]
        return script[step] if step < len(script) else 500

    def launch(self, plan, masks=None):
        samples = np.zeros(len(plan.seqs), np.int32)
        record = []
        for row, seq in enumerate(plan.seqs):
            r = self.requests[seq.key]
            assert seq.epoch == r.epoch and seq.slot == r.slot
            table = [] if seq.new_in_slot else self.tables[seq.slot]
            self.tables[seq.slot] = table = table + list(seq.new_pages)
            assert table == r.pages, "the page-table changes do not add up to the request's pages"
            end = seq.start + seq.num_tokens
            assert len(table) >= pages_needed(end, self.page_size), "a token has no page"
            self._check_writable(table, range(seq.start, end))
            if seq.token_ids is None:  # fed from the device: the previous step sampled it for r
                prev_plan, prev_samples = self._last
                previous = prev_plan.seqs[seq.prev_row]
                assert previous.key == seq.key and previous.samples
                inputs = [int(prev_samples[seq.prev_row])]
            else:
                inputs = list(seq.token_ids)
            assert len(inputs) == seq.num_tokens
            self.fed.setdefault(r.request_id, {}).update(zip(range(seq.start, end), inputs))
            if seq.samples:
                samples[row] = self._token(r.seed, seq.sample_step)
            record.append((r.seed, seq.start, seq.num_tokens, seq.is_prefill))
        self.steps.append(record)
        self._last = (plan, samples)
        return FakeLaunched(plan, samples)


@pytest.fixture
def make_engine(stories_dir):
    def make(scripts, max_num_seqs=4, num_pages=None, max_model_len=64, budget=16, **kw):
        engine = Engine(EngineArgs(model=str(stories_dir), max_num_seqs=max_num_seqs, page_size=4,
                                   num_pages=num_pages, max_model_len=max_model_len,
                                   max_num_batched_tokens=budget, **kw))
        fake = FakeRunner(scripts, engine.tracker.requests, engine.scheduler.allocator)
        fake.head, engine.runner = engine.runner.head, fake  # the draw head, whose update is update_from_output
        engine.runner.step_token_limit = budget  # every step program "compiled"
        return engine
    return make


def run_all(engine, requests):
    ids = [engine.add_request(p, params) for p, params in requests]
    final = {}
    for _ in range(10_000):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            break
    for rid in ids:  # every position the model was fed holds that position's prompt or output token
        out = final[rid]
        history = out.prompt_token_ids + out.outputs[0].token_ids
        assert all(history[p] == t for p, t in engine.runner.fed.get(rid, {}).items()), rid
    return [final[i] for i in ids]


def params(seed, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 50), **kw)


# "Once upon a time" continues ", there was a little g" = 432 383 286 261 376 298
STORY = [432, 383, 286, 261, 376, 298]


@pytest.mark.parametrize("eos", [1, 2])
def test_stops_on_each_eos_id(make_engine, eos):
    engine = make_engine({7: STORY[:3] + [eos] + STORY[3:]})
    out = run_all(engine, [([1, 403, 407, 261, 378], params(7))])[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == eos
    assert out.token_ids == STORY[:3] + [eos]
    assert out.text == ", there was"  # the EOS token adds no text


def test_ignore_eos_and_stop_token_ids(make_engine):
    engine = make_engine({7: STORY[:2] + [2] + STORY[2:]})
    out = run_all(engine, [([1, 403], params(7, ignore_eos=True, stop_token_ids=[261]))])[0].outputs[0]
    assert out.token_ids == STORY[:2] + [2, 286, 261]
    assert out.finish_reason == "stop" and out.stop_reason == 261


def test_stop_string_cuts_text_even_across_tokens(make_engine):
    engine = make_engine({7: STORY})
    out = run_all(engine, [([1, 403, 407, 261, 378], params(7, stop=["re was"]))])[0].outputs[0]
    assert out.text == ", the"
    assert out.finish_reason == "stop" and out.stop_reason == "re was"


def test_streamed_pieces_concatenate_to_final_text(make_engine):
    engine = make_engine({7: STORY})
    rid = engine.add_request([1, 403, 407, 261, 378], params(7, max_tokens=6, stop=["xyz"]))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final.request_id == rid and final.outputs[0].finish_reason == "length"
    assert "".join(pieces) == final.outputs[0].text == ", there was a little g"


def test_max_tokens_and_context_length(make_engine):
    engine = make_engine({1: STORY * 20, 2: STORY * 20}, max_model_len=20)
    by_tokens, by_context = run_all(engine, [([1, 403], params(1, max_tokens=5)),
                                             ([1] * 15, params(2, max_tokens=None))])
    assert len(by_tokens.outputs[0].token_ids) == 5 and by_tokens.outputs[0].finish_reason == "length"
    assert len(by_context.outputs[0].token_ids) == 5 and by_context.outputs[0].finish_reason == "length"


def test_long_prompt_is_chunked_while_decode_continues(make_engine):
    engine = make_engine({1: STORY * 10, 2: STORY}, max_model_len=64, budget=8)
    engine.add_request([1, 403], params(1, max_tokens=30))
    engine.step()  # request 1 prefilled
    engine.add_request([1] + [403] * 40, params(2, max_tokens=3))
    first = len(engine.runner.steps)
    while engine.has_unfinished():
        engine.step()
    steps = [s for s in engine.runner.steps[first:] if any(seed == 2 and pre for seed, _, _, pre in s)]
    # Each step carries request 1's decode token and as much of request 2's prompt as the budget leaves.
    assert all((1, s[0][1], 1, False) == s[0] and sum(n for _, _, n, _ in s) <= 8 for s in steps)
    chunks = [(start, n) for s in steps for seed, start, n, pre in s if seed == 2]
    assert [n for _, n in chunks] == [7, 7, 7, 7, 7, 6]  # 41 prompt tokens, 7 per step next to the decode
    assert [start for start, _ in chunks] == [0, 7, 14, 21, 28, 35]


def _arriving_while_the_device_runs(engine, prompt, sampling):
    """Make `prompt` arrive while the engine waits for the step in flight (during its next read)."""
    read = engine._read

    def read_and_receive(launched):
        engine._read = read
        engine.add_request(prompt, sampling)
        return read(launched)
    engine._read = read_and_receive


def test_a_burst_arriving_during_a_prefill_only_step_joins_the_next_step(make_engine):
    # The first request of a burst finds the engine idle and is prefilled alone; the rest arrive while
    # that step runs. The engine reads that step before planning the next, so the next step takes them
    # all (with the first request's decode) instead of holding that decode alone.
    engine = make_engine({1: STORY, 2: STORY, 3: STORY}, budget=16)
    engine.add_request([1, 403, 407], params(1, max_tokens=5))
    engine.step()
    assert engine.runner.steps[-1] == [(1, 0, 3, True)]
    _arriving_while_the_device_runs(engine, [1, 403, 407, 261], params(2, max_tokens=5))
    engine.step()
    assert engine.runner.steps[-1] == [(1, 3, 1, False), (2, 0, 4, True)]
    # Decoding steps stay pipelined: the next step is planned before the one in flight is read, so a
    # request arriving during that read waits for the step after.
    _arriving_while_the_device_runs(engine, [1, 403], params(3, max_tokens=5))
    engine.step()
    assert [seed for seed, *_ in engine.runner.steps[-1]] == [1, 2]
    engine.step()
    assert [seed for seed, *_ in engine.runner.steps[-1]] == [1, 2, 3]
    while engine.has_unfinished():
        engine.step()
    assert_pages_released(engine.scheduler)


def test_step_counters_add_up_what_each_launched_step_held(make_engine):
    # The counters /metrics shows as jaxserve:engine_step_*: steps, and the sequences and tokens in them.
    engine = make_engine({s: STORY for s in range(4)}, budget=16)
    stats, steps = engine.stats, engine.runner.steps
    run_all(engine, [([1, 403, 407, 261], params(0, max_tokens=6))])
    assert stats.step_sequences == stats.steps == len(steps)  # one request: one sequence per step
    alone = stats.steps
    run_all(engine, [([1, 403, 407, 261], params(s, max_tokens=6)) for s in range(1, 4)])
    assert stats.steps == len(steps)
    assert stats.step_sequences == sum(len(step) for step in steps)
    assert stats.step_tokens == sum(n for step in steps for _, _, n, _ in step)
    assert stats.step_tokens >= 4 * 4 + 4 * 5  # every prompt token, and every sampled token but the last
    assert stats.steps - alone < 3 * alone / 2  # three requests at once share their steps


def test_preemption_under_page_pressure_completes_everything(make_engine):
    # 8 slots but only 12 usable pages of 4 tokens: 8 requests needing ~6 pages each must take turns.
    scripts = {s: [(s * 7 + i) % 400 + 3 for i in range(30)] for s in range(8)}
    engine = make_engine(scripts, max_num_seqs=8, num_pages=13, max_model_len=24)
    outs = run_all(engine, [([1, 403, 407, 261], params(s, max_tokens=18)) for s in range(8)])
    for s, out in enumerate(outs):
        assert out.outputs[0].token_ids == scripts[s][:18]
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.allocator.num_usable == 12
    assert_pages_released(engine.scheduler)


def test_abort_frees_slot_and_pages_at_next_step(make_engine):
    engine = make_engine({1: STORY * 10, 2: STORY * 10})
    a = engine.add_request([1, 403], params(1, max_tokens=40))
    engine.add_request([1, 403, 407], params(2, max_tokens=5))
    for _ in range(3):
        engine.step()
    engine.abort(a)
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == a]
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert_pages_released(engine.scheduler)


def test_abort_of_waiting_request(make_engine):
    engine = make_engine({s: STORY for s in range(6)}, max_num_seqs=1)
    ids = [engine.add_request([1, 403], params(s, max_tokens=4)) for s in range(3)]
    engine.step()
    engine.abort(ids[2])  # still queued behind the others
    finished = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.outputs[0].finish_reason
    assert finished == {ids[0]: "length", ids[1]: "length", ids[2]: "abort"}
    assert_pages_released(engine.scheduler)


def test_num_pages_too_small_for_one_context_is_refused(stories_dir):
    with pytest.raises(ValueError, match="num_pages"):
        Engine(EngineArgs(model=str(stories_dir), page_size=4, num_pages=8, max_model_len=64))


def test_compile_counter_sees_a_program_warm_up_did_not_build(stories_dir, no_program_cache):
    # Guards the zero-compilation assertions elsewhere: the counter must actually see compilations. One
    # program, traced here (not loaded from the run's program cache), so warm-up really lowers something.
    engine = Engine(EngineArgs(model=str(stories_dir), max_num_seqs=2, max_num_batched_tokens=8, token_buckets=(8,),
                               max_model_len=64))
    engine.warmup()
    assert engine.compile_events.lowered_in_warmup > 0  # warm-up's own lowerings are counted apart
    before = engine.compilations_since_warmup
    engine.runner.launch(StepPlan([], 1), with_logits=True).read()  # a variant warm-up did not build
    assert engine.compilations_since_warmup > before


def _run_all(engine, prompts, max_tokens=6) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    tokens = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                tokens[o.request_id] = o.outputs[0].token_ids
    return [tokens[i] for i in ids]


def test_background_warmup_serves_with_the_ready_programs_and_compiles_nothing_on_the_step_path(
        stories_dir, monkeypatch, no_program_cache):
    """Ready after one program: until the others are compiled, steps fit the ready ones (a long prompt
    prefills in small chunks) and give the same tokens; nothing compiles outside warm-up."""
    # Three buckets, not the five defaults: one ready at first, two compiled behind it (each compiles for seconds).
    args = EngineArgs(model=str(stories_dir), max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64,
                      token_buckets=(4, 16, 64))
    prompts = [list(range(3, 60)), list(range(100, 109)), [7, 8, 9]]
    full = Engine(args)
    full.warmup()
    expected = _run_all(full, prompts)

    release = threading.Event()
    lower = StepCompiler.lower

    def held_back(compiler, layout):  # the background part waits until the test has served with one program
        if compiler.ready_buckets:
            assert release.wait(120)
        return lower(compiler, layout)

    monkeypatch.setattr(StepCompiler, "lower", held_back)
    engine = Engine(args)
    engine.warmup(background=True)
    runner, compiler = engine.runner, engine.runner.compiler
    assert compiler.ready_buckets == (4,) and compiler.compile_order()[0] == 4  # holds a decode of all 4 slots
    assert engine.warmup_report is None and not compiler.warmup_done.is_set()
    assert _run_all(engine, prompts) == expected
    assert engine.compilations_since_warmup == 0
    release.set()
    assert compiler.warmup_done.wait(300)
    assert compiler.ready_buckets == tuple(runner.layouts) and engine.warmup_report.programs == len(runner.layouts)
    assert runner.step_token_limit == 64 and "all_programs" in engine.startup_seconds
    assert _run_all(engine, prompts) == expected
    assert engine.compilations_since_warmup == 0


def test_a_bucket_that_fails_to_compile_in_the_background_leaves_the_others_serving(stories_dir, monkeypatch,
                                                                                    no_program_cache):
    lower = StepCompiler.lower

    def failing(compiler, layout):
        if layout.tokens == 16:
            raise RuntimeError("out of compiler memory")
        return lower(compiler, layout)

    monkeypatch.setattr(StepCompiler, "lower", failing)
    engine = Engine(EngineArgs(model=str(stories_dir), max_num_seqs=4, max_model_len=128, max_num_batched_tokens=64))
    engine.warmup(background=True)
    compiler = engine.runner.compiler
    assert compiler.warmup_done.wait(300)
    assert compiler.ready_buckets == (1, 2, 4, 8, 32, 64) and engine.warmup_report.programs == 6
    assert compiler.layout_for(9).tokens == 32  # a 9..16-token step pads up to the next ready program
    assert len(_run_all(engine, [list(range(3, 14)), [5, 6]])[0]) == 6
    assert engine.compilations_since_warmup == 0


# ---- prefix caching (scheduler + engine, fake model) ------------------------------------------------------

PREFIX = [1] + list(range(300, 321))  # 22 tokens: 5 full pages of 4, then 2


def prefill_starts(engine, seed):
    return [(start, n) for step in engine.runner.steps for s, start, n, pre in step if s == seed and pre]


def test_prefix_hit_prefills_only_the_uncached_rest(make_engine):
    engine = make_engine({s: STORY for s in range(10)})
    run_all(engine, [(PREFIX, params(0, max_tokens=3))])
    assert prefill_starts(engine, 0) == [(0, 16), (16, 6)]
    cases = [
        (1, PREFIX[:14] + [400, 401, 402], 12),  # shared prefix ends mid-page: the 3 full pages before it
        (2, PREFIX[:16], 12),  # the whole prompt is cached: its last page is recomputed for the logits
        (3, PREFIX[:15], 12),  # cached up to its last token: the hit stops at the page before it
        (4, PREFIX + [9], 20),  # all 5 full pages of the first prompt
        (5, [1, 402] + PREFIX[2:], 0),  # differs in the first page: nothing after it can be shared
    ]
    for seed, prompt, hit in cases:
        out = run_all(engine, [(prompt, params(seed, max_tokens=3))])[0]
        chunks = prefill_starts(engine, seed)
        assert chunks[0][0] == hit and sum(n for _, n in chunks) == len(prompt) - hit, seed
        assert out.num_cached_tokens == hit
        assert out.outputs[0].token_ids == STORY[:3]
    scheduler = engine.scheduler
    assert scheduler.prefix_cache_hits == 12 + 12 + 12 + 20
    assert scheduler.prefix_cache_queries == len(PREFIX) + sum(len(c[1]) for c in cases)
    assert_pages_released(scheduler)


def test_concurrent_requests_share_pages_but_never_write_them(make_engine):
    engine = make_engine({s: STORY * 3 for s in range(4)})
    engine.add_request(PREFIX, params(0, max_tokens=12))
    engine.step()  # the first request's prompt is prefilled and its full pages registered
    for seed in (1, 2, 3):
        engine.add_request(PREFIX[:13] + [400 + seed] * 5, params(seed, max_tokens=12))
    engine.step()
    scheduler = engine.scheduler
    shared = scheduler.running[0].pages[:3]
    assert all(r.pages[:3] == shared for r in scheduler.running)
    assert [scheduler.allocator.refcount(p) for p in shared] == [4, 4, 4]
    # FakeRunner checks on every step that writes land only in unshared, uncached pages.
    while engine.has_unfinished():
        engine.step()
    assert [prefill_starts(engine, s)[0][0] for s in (1, 2, 3)] == [12, 12, 12]
    assert_pages_released(scheduler)


def test_generated_text_is_cached_for_the_next_turn(make_engine):
    engine = make_engine({0: STORY * 3, 1: STORY})
    first = run_all(engine, [(PREFIX[:10], params(0, max_tokens=12))])[0]
    # 10 prompt + 12 generated: 21 tokens have K/V (the last sampled one never went through the model).
    history = PREFIX[:10] + first.outputs[0].token_ids
    second = run_all(engine, [(history + [5, 6, 7], params(1, max_tokens=2))])[0]
    assert second.num_cached_tokens == 20  # 5 full pages, 2 of them made only of generated tokens
    assert prefill_starts(engine, 1) == [(20, len(history) + 3 - 20)]


def test_cache_salt_keeps_requests_apart(make_engine):
    engine = make_engine({s: STORY for s in range(5)})
    run_all(engine, [(PREFIX, params(0, max_tokens=2, cache_salt="tenant-a"))])
    hits = [run_all(engine, [(PREFIX, params(seed, max_tokens=2, cache_salt=salt))])[0].num_cached_tokens
            for seed, salt in [(1, None), (2, "tenant-b"), (3, "tenant-a")]]
    assert hits == [0, 0, 20]
    assert run_all(engine, [(PREFIX, params(4, max_tokens=2))])[0].num_cached_tokens == 20  # (1) cached it
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_no_prefix_caching_recomputes_every_prompt(make_engine):
    engine = make_engine({s: STORY for s in range(3)}, enable_prefix_caching=False)
    outs = run_all(engine, [(PREFIX, params(0, max_tokens=3))])
    outs += run_all(engine, [(PREFIX, params(1, max_tokens=3))])
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert prefill_starts(engine, 1) == [(0, 16), (16, 6)]
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is None and scheduler.prefix_cache_queries == 0
    assert_pages_released(scheduler)


def test_preempted_request_reuses_its_own_cached_pages(make_engine):
    # 2 slots, 9 usable pages, two requests of 6 pages each: the newer one is preempted once the pool is
    # exhausted. Its full pages stay cached, so its recomputation starts after them.
    scripts = {0: [(7 * i) % 400 + 3 for i in range(30)], 1: [(11 * i) % 400 + 3 for i in range(30)]}
    engine = make_engine(scripts, max_num_seqs=2, num_pages=10, max_model_len=24)
    outs = run_all(engine, [([1] + [401] * 7, params(0, max_tokens=14)), ([1] + [402] * 7, params(1, max_tokens=14))])
    assert [o.outputs[0].token_ids for o in outs] == [scripts[0][:14], scripts[1][:14]]
    assert engine.scheduler.num_preemptions >= 1
    starts = prefill_starts(engine, 1)
    assert starts[0] == (0, 8) and len(starts) > 1
    assert starts[1][0] >= 8, starts  # at least its prompt's pages survived the preemption
    assert_pages_released(engine.scheduler)
