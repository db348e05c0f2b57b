"""`update_from_output` driven by a fake model whose logits are computed by hand (no JAX, no compile).

The model reads bytes (the byte-level tokenizer: token 3 + b is byte b) and predicts the next letter of
the alphabet after a letter, "a" after anything else, and EOS after "q". A fake proposer drafts tokens for
some requests; the fake runner verifies them as speculative decoding does (greedy: drafts stand while
they equal the model's own choice, then the model's choice at the first difference), so a step hands back
0 (a prompt chunk that draws nothing), 1 or several accepted tokens per sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.sampling.grammar import GrammarCompiler
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.pages import pages_needed
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.stats import EngineStats
from jaxserve.scheduling.step import SampledTokens, StepPlan
from jaxserve.scheduling.update import RequestTracker
from jaxserve.text.tokenizer import Tokenizer
from tests.page_checks import assert_pages_released

TOKENIZER = Tokenizer.byte_level()
EOS = 2
PAGE = 4


def byte(c: str) -> int:
    return 3 + ord(c)


def logits_after(token: int) -> np.ndarray:
    """The fake model's logits for the token after `token`: a peak at its choice, falling off linearly."""
    if token == byte("q"):
        choice = EOS
    elif byte("a") <= token <= byte("z"):
        choice = byte("a") + (token - byte("a") + 1) % 26
    else:
        choice = byte("a")
    return -np.abs(np.arange(TOKENIZER.vocab_size) - choice).astype(np.float32)


class FakeModel:
    """Runs a step: checks what it is fed against each request's history and page table, and draws."""

    def __init__(self, tracker: RequestTracker):
        self.tracker = tracker
        self.tables: dict[int, list[int]] = {}

    def run(self, step: StepPlan) -> SampledTokens:
        draws = 1 + max(seq.num_draft_tokens for seq in step.seqs)
        tokens = np.zeros((len(step.seqs), draws), np.int32)
        accepted = np.zeros(len(step.seqs), np.int32)
        for row, seq in enumerate(step.seqs):
            request = self.tracker.requests[seq.key]
            table = ([] if seq.new_in_slot else self.tables[seq.slot]) + list(seq.new_pages)
            self.tables[seq.slot] = table
            assert table == request.pages and len(table) >= pages_needed(seq.start + seq.num_tokens, PAGE)
            span = list(seq.token_ids)  # this loop reads every step before planning the next: nothing pending
            known = request.token_ids[seq.start:seq.start + seq.num_tokens - seq.num_draft_tokens]
            assert span[:len(known)] == known  # the span continues the request's true history
            if not seq.samples:
                continue
            # One draw after the last real token and after each draft; drafts stand while they match.
            choices = [int(np.argmax(logits_after(t))) for t in span[len(span) - seq.num_draft_tokens - 1:]]
            drafts = span[len(span) - seq.num_draft_tokens:]
            stand = next((i for i, d in enumerate(drafts) if d != choices[i]), len(drafts))
            tokens[row, :stand + 1] = choices[:stand + 1]
            accepted[row] = stand + 1
        return SampledTokens(tokens, accepted)


def continuation(text: str, n: int) -> list[int]:
    """What the fake model says after `text`, greedily, for n tokens."""
    out, last = [], TOKENIZER.encode(text)[-1]
    for _ in range(n):
        last = int(np.argmax(logits_after(last)))
        out.append(last)
    return out


@pytest.fixture
def setup():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_model_len=64, max_num_batched_tokens=16),
                          CacheConfig(page_size=PAGE, num_pages=80))
    tracker = RequestTracker(scheduler, TOKENIZER, GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size), EngineStats(),
                             max_model_len=64)
    return scheduler, tracker, FakeModel(tracker)


def add(tracker: RequestTracker, name: str, prompt: str, **params) -> str:
    choices = tracker.new_choices(TOKENIZER.encode(prompt), SamplingParams(temperature=0, **params), name, prompt)
    tracker.add(choices)
    return name


def test_zero_one_and_several_accepted_tokens_per_sequence_stop_strings_mid_span_and_pages(setup):
    scheduler, tracker, model = setup
    drafts = {  # the proposer: how many of its drafts are the model's own continuation, then one wrong token
        "spec": lambda r: continuation(TOKENIZER.decode(r.token_ids), 2) + [byte("!")],
        "stop": lambda r: continuation(TOKENIZER.decode(r.token_ids), 3),
        "eos": lambda r: continuation(TOKENIZER.decode(r.token_ids), 3),
    }
    add(tracker, "long", "The quick brown fox jumps over", max_tokens=3)  # 31 tokens: chunks of a 16-token budget
    add(tracker, "plain", "x", max_tokens=5)
    add(tracker, "spec", "c", max_tokens=7)
    add(tracker, "stop", "a", max_tokens=20, stop=["fg"])
    add(tracker, "eos", "o", max_tokens=20)
    finals, accepted_counts = {}, {}
    for _ in range(40):
        for request in tracker.requests.values():
            if request.request_id in drafts and request.is_decoding and not request.num_pending:
                request.draft_token_ids = drafts[request.request_id](request)
        step = scheduler.schedule()
        if step.empty:
            break
        sampled = model.run(step)
        for row, seq in enumerate(step.seqs):
            accepted_counts.setdefault(tracker.requests[seq.key].request_id, set()).add(int(sampled.num_accepted[row]))
        for out in tracker.update_from_output(step, sampled):
            assert len(out.new_token_ids) <= 4
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert not tracker.has_unfinished()

    assert accepted_counts["long"] == {0, 1}  # mid-prompt chunks draw nothing, the last one draws once
    assert accepted_counts["plain"] == {0, 1}  # its prompt was split too, by the long one's chunks
    assert 3 in accepted_counts["spec"]  # two drafts stand, the third is corrected
    assert 4 in accepted_counts["stop"]  # all three drafts stand, plus the model's next token

    plain = finals["plain"]
    assert (plain.text, plain.finish_reason) == ("yzabc", "length")
    spec = finals["spec"]
    assert (spec.text, spec.finish_reason, len(spec.token_ids)) == ("defghij", "length", 7)
    # "b" from the prefill, then c d e + f, then g h i + j: the stop string "fg" ends at "g", the second
    # token of that span. The text stops before it; the tokens after "g" are dropped.
    stop = finals["stop"]
    assert (stop.text, stop.finish_reason, stop.stop_reason) == ("bcde", "stop", "fg")
    assert stop.token_ids == [byte(c) for c in "bcdefg"]
    # p, then q + EOS + a + b in one span: EOS ends it, "a" and "b" are dropped.
    eos = finals["eos"]
    assert (eos.text, eos.finish_reason, eos.stop_reason) == ("pq", "stop", EOS)
    assert eos.token_ids == [byte("p"), byte("q"), EOS]
    assert finals["long"].text == "stu" and finals["long"].finish_reason == "length"
    assert tracker.stats.generation_tokens == 3 + 5 + 7 + 6 + 3
    assert_pages_released(scheduler)


def test_a_rejected_draft_is_computed_again_from_where_it_went_wrong(setup):
    scheduler, tracker, model = setup
    add(tracker, "spec", "c", max_tokens=6)
    starts = []
    while tracker.has_unfinished():
        for request in tracker.requests.values():
            if request.is_decoding and not request.num_pending:
                request.draft_token_ids = [byte("!")] * 3  # always wrong: only the correction stands
        step = scheduler.schedule()
        starts += [(seq.start, seq.num_tokens, seq.num_draft_tokens) for seq in step.seqs]
        request = next(iter(tracker.requests.values()))
        tracker.update_from_output(step, model.run(step))
        if tracker.has_unfinished():
            assert request.num_computed == len(request.token_ids) - 1  # the drafts' K/V no longer counts
    # Prompt [BOS, c] then one real token per step, each span re-reading from the position after the last
    # accepted token (its drafts were at positions the next span writes again).
    assert starts[0] == (0, 2, 0)
    assert [start for start, _, _ in starts[1:]] == [2, 3, 4, 5, 6]
    assert all(drafted > 0 for _, _, drafted in starts[1:-1])
    assert_pages_released(scheduler)


def test_a_draw_for_a_request_aborted_meanwhile_is_discarded(setup):
    scheduler, tracker, model = setup
    add(tracker, "a", "k", max_tokens=8)
    first = scheduler.schedule()
    tracker.update_from_output(first, model.run(first))
    step = scheduler.schedule()  # the request's decode is in flight...
    aborted = tracker.abort("a")  # ...when its client goes away
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"]
    late = SampledTokens(np.full((1, 1), byte("l"), np.int32), np.ones(1, np.int32))
    assert tracker.update_from_output(step, late) == []
    assert_pages_released(scheduler)
