"""Checks of a vision-language engine's answers against transformers' golden outputs (tests/fixtures/vlm), shared
by the Gemma 3 and Qwen2.5-VL engine tests.

A `Golden` holds one family's golden.npz. `check(case, out)` asserts the engine's answer to a fixture
conversation: the processor's prompt ids, transformers' greedy tokens, and for every generated position (and
every prompt position, with `prompt_scores`) the chosen token's and the top log-probabilities within 1e-4 of
log_softmax of transformers' full-forward logits (the engine's logits seen through its draws: the API returns
no logits); `check_batched_with_text(llm)` does so for all four at once beside text requests.
`recording_llm` builds an `LLM` that keeps every step plan its scheduler makes (`llm.plans`);
`check_nothing_compiles_or_leaks(llm)` runs images, text and both mixed and checks the invariants after.
"""

from __future__ import annotations

import numpy as np

from jaxserve.sampling.params import SamplingParams
from tests.page_checks import assert_pages_released
from tests.test_vlm_requests import CONVERSATIONS, VLM

CASES = {"text_only": [{"role": "user", "content": "Say something short."}], **CONVERSATIONS}
TOP = 5


def greedy(logprobs: bool = True, prompt: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP if logprobs else None,
                          prompt_logprobs=TOP if prompt else None)


def recording_llm(family: str, **sizes):
    """An `LLM` of the family's fixture checkpoint whose step plans are kept in `llm.plans`."""
    from jaxserve import LLM
    llm = LLM(str(VLM / family), **sizes)
    plans = []
    schedule = llm.engine.scheduler.schedule
    llm.engine.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    llm.plans = plans
    return llm


def check_nothing_compiles_or_leaks(llm) -> None:
    """Images, text and both mixed through `llm`: nothing compiled after warm-up; the encoder cache holds rows
    only for images no request needs, and lets go of them with the prefix cache; every page comes back."""
    text = [{"role": "user", "content": "Tell me a story about a cat."}]
    llm.chat([CASES["two_images"], text, CASES["second_turn"]], greedy(prompt=False))
    engine = llm.engine
    assert engine.compilations_since_warmup == 0
    assert not engine.has_unfinished()
    cache = engine.images.cache
    assert cache.num_referenced == 0 and cache.num_entries > 0
    llm.reset_prefix_cache()
    assert cache.num_entries == 0 and cache.num_bytes == 0
    assert_pages_released(engine.scheduler)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def check_position(entries: dict, reference: np.ndarray, token: int) -> None:
    """A position's logprobs (the chosen token, the top ones) against the golden logits' log_softmax."""
    ref = log_softmax(reference)
    for tid, entry in entries.items():
        assert abs(entry.logprob - ref[tid]) < 1e-4, (tid, entry.logprob, ref[tid])
    top = sorted(entries.items(), key=lambda kv: kv[1].rank)[:TOP]
    assert token in entries
    np.testing.assert_allclose([e.logprob for _, e in top], np.sort(ref)[::-1][:len(top)], atol=1e-4, rtol=0)


class Golden:
    def __init__(self, family: str):
        self.arrays = dict(np.load(VLM / family / "golden.npz"))

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def check(self, case: str, out, prompt_scores: bool = True) -> None:
        ids, logits = self[f"{case}.input_ids"].tolist(), self[f"{case}.logits"]
        assert list(out.prompt_token_ids) == ids
        tokens = out.outputs[0].token_ids
        assert tokens == self[f"{case}.greedy"].tolist(), case
        for k, (token, entries) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            check_position(entries, logits[len(ids) - 1 + k], token)
        if prompt_scores:
            assert out.prompt_logprobs[0] is None
            for position in range(1, len(ids)):
                check_position(out.prompt_logprobs[position], logits[position - 1], ids[position])

    def check_batched_with_text(self, llm) -> None:
        """Every conversation at once, between text requests, through `llm` (a `recording_llm`): each still gives
        transformers' tokens and scores, and some step mixed image and text spans."""
        text = [{"role": "user", "content": "Tell me a story about a cat."}]
        cases = ["one_image", "text_only", "two_images", "second_turn"]
        llm.reset_prefix_cache()  # else the prompts' pages, images included, come from the tests before
        start = len(llm.plans)
        outs = llm.chat([text, *(CASES[c] for c in cases), text], greedy(prompt=False))
        for case, out in zip(cases, outs[1:-1]):
            self.check(case, out, prompt_scores=False)
        assert outs[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids
        steps = [plan for plan in llm.plans[start:] if any(s.images for s in plan.seqs)]
        assert any(any(not s.images for s in plan.seqs) for plan in steps), "no step mixed images with text"

    def image_offsets(self, case: str) -> list[tuple[int, int]]:
        """(offset, length) of each image's tokens in the case's prompt."""
        marked = np.concatenate([[0], self[f"{case}.token_type_ids"], [0]])
        edges = np.flatnonzero(np.diff(marked))
        return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
