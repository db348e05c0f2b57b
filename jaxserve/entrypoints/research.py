"""Looking inside: drive the model's jitted step by hand, read its KV pages, score texts.

`Workbench` holds a model, its paged KV cache and its compiled step (the same ones `LLM` and the server
run). A `Sequence` is a row of the page table with pages of its own; `step` runs one ragged step over
chunks of several sequences (a prefill chunk, decode tokens, both at once) and returns every row's
logits, exactly what the engine computes. `kv` reads a sequence's keys and values back out of its
pages, `score` gives each token's log-probability under the model.

    bench = Workbench.load("../shared/models/stories260K")
    seq = bench.new_sequence(64)
    first = bench.step([(seq, bench.tokenizer.encode("Once upon a time"))])
    bench.step([(seq, [first.next_tokens[0]])])  # one decode step
    bench.release(seq)

Don't drive a workbench while its `llm` is generating: both use the same pages and step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.entrypoints.llm import LLM
from jaxserve.model.kv_cache import QuantizedPages
from jaxserve.scheduling.pages import pages_needed
from jaxserve.scheduling.step import ScheduledSeq, StepPlan
from pallas_kernels.kv_quant import dequantize_kv


@dataclasses.dataclass
class Sequence:
    """One sequence of a workbench: its page-table row, its pages and the tokens whose K/V they hold."""
    slot: int
    pages: list[int]
    page_size: int
    token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.page_size


@dataclasses.dataclass
class StepResult:
    next_tokens: list[int]  # the greedy token after each chunk
    logits: list[np.ndarray]  # each chunk's [chunk tokens, vocab] float32 logits: the next-token scores per row


@dataclasses.dataclass
class TokenScores:
    """Log-probabilities of a text's tokens: `logprobs[i]` is log p(token i | tokens before it), for i >= 1
    (the first token has no context to be scored by)."""
    token_ids: list[int]
    tokens: list[str]
    logprobs: np.ndarray  # [len(token_ids) - 1] natural log

    @property
    def surprisal_bits(self) -> np.ndarray:
        return -self.logprobs / np.log(2.0)

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.logprobs.mean()))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _rows(pages, page_ids, offsets) -> np.ndarray:
    """[kv_heads, tokens, head_dim] of a layer's pages at (page, offset) pairs; int8 / fp8 pages dequantized."""
    if isinstance(pages, QuantizedPages):  # the scales lane-dense: a token's at its flat slot
        slots = np.asarray(page_ids) * pages.codes.shape[2] + np.asarray(offsets)
        scales = pages.scales.reshape(pages.scales.shape[0], -1)[:, slots]
        return np.asarray(dequantize_kv(pages.codes[:, page_ids, offsets], scales))
    return np.asarray(pages[:, page_ids, offsets])


class Workbench:
    def __init__(self, llm: LLM):
        self.llm = llm
        engine = llm.engine
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.page_size = engine.cache_config.page_size
        self.max_step_tokens = engine.scheduler_config.max_num_batched_tokens
        self.allocator = engine.scheduler.allocator
        self.runner = engine.runner
        self.free_slots = list(range(engine.scheduler_config.max_num_seqs))

    @classmethod
    def load(cls, model: str | None = None, **engine_kwargs) -> "Workbench":
        """A workbench over `LLM(model, **engine_kwargs)` (None: the built-in stories260K). With `warmup=False`
        the engine's step programs are not compiled at start: `step` and `score` run one of their own (every
        row's logits), compiled at the first step of each size, and `llm.generate` compiles what it uses."""
        return cls(LLM(model, **engine_kwargs))

    def new_sequence(self, max_tokens: int) -> Sequence:
        """A sequence with pages for `max_tokens` tokens (release it when done)."""
        if not self.free_slots:
            raise RuntimeError("every page-table row is in use: release a sequence first")
        pages = self.allocator.allocate(pages_needed(max_tokens, self.page_size))
        if pages is None:
            raise RuntimeError(f"not enough free KV pages for {max_tokens} tokens")
        return Sequence(self.free_slots.pop(0), pages, self.page_size)

    def release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        self.free_slots.insert(0, seq.slot)
        seq.pages = []

    def step(self, work: list[tuple[Sequence, list[int]]]) -> StepResult:
        """One ragged step: for each (sequence, token ids), write the tokens' K/V after the sequence's
        current length and compute every row's logits. Sequences are extended in place."""
        for seq, ids in work:
            if seq.length + len(ids) > seq.capacity:
                raise ValueError(f"sequence in row {seq.slot} holds {seq.capacity} tokens: "
                                 f"{seq.length} + {len(ids)} do not fit")
        if sum(len(ids) for _, ids in work) > self.max_step_tokens:
            raise ValueError(f"one step takes at most {self.max_step_tokens} tokens")
        spans = [ScheduledSeq.for_sequence(seq.slot, seq.pages, seq.length, list(ids)) for seq, ids in work]
        out = self.runner.run(StepPlan.of(spans))
        for seq, ids in work:
            seq.token_ids.extend(int(t) for t in ids)
        return StepResult([int(t) for t in out.samples], [out.logits[rows] for rows in out.rows])

    def kv(self, seq: Sequence, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's keys and values at `layer`, read from its pages: [tokens, kv_heads, head_dim] each."""
        cache = self.runner.kv_cache
        positions = np.arange(seq.length)
        page_ids, offsets = np.asarray(seq.pages)[positions // self.page_size], positions % self.page_size
        # Gathered on the device ([kv_heads, pages, page_size, head_dim] per layer): only the sequence's rows
        # come to the host, not the layer's whole page pool.
        return tuple(_rows(pool[layer], page_ids, offsets).transpose(1, 0, 2) for pool in (cache.k, cache.v))

    def page_map(self, seq: Sequence) -> list[tuple[int, int]]:
        """(page id, tokens of the sequence it holds) for each of the sequence's pages."""
        return [(page, max(0, min(self.page_size, seq.length - i * self.page_size)))
                for i, page in enumerate(seq.pages)]

    def score(self, text: str | list[int]) -> TokenScores:
        """Each token's log-probability given the ones before it (a text is tokenized with BOS first)."""
        ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
        seq = self.new_sequence(len(ids))
        try:
            logits = [chunk_logits for start in range(0, len(ids), self.max_step_tokens)
                      for chunk_logits in self.step([(seq, ids[start:start + self.max_step_tokens])]).logits]
        finally:
            self.release(seq)
        rows = np.concatenate(logits)[:-1]  # row i predicts token i + 1
        logprobs = log_softmax(rows)[np.arange(len(ids) - 1), ids[1:]]
        return TokenScores(ids, [self.tokenizer.token_str(t) for t in ids], logprobs.astype(np.float32))
