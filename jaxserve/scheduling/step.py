"""What crosses the layers once per step, as plain data: the plan going down, the samples coming back.

1. `StepPlan` is what the scheduler decided: per scheduled sequence (`ScheduledSeq`) its token span
   (start, count, and the ids, or "the previous step's sample row r"), the page-table change since the
   last step, how many draws follow the span (its sample rows: one, or one per draft token plus one
   when speculative drafts are verified) and everything the batch builder needs to fill the device batch
   (sampling settings, the first-chunk flag, prompt-logprob targets). It holds no request objects and no
   arrays: the runner turns it into the device batch, `update_from_output` reads it back.
2. `SampledTokens` is what the draw head's device step answered, on the host: per sequence row up to
   K + 1 tokens and how many of them stand (accepted), and the log-probabilities when some sequence asked
   for them. (Another output head brings its own result type: `jaxserve/execution/heads/`.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from jaxserve.sampling.params import BiasTable, SamplingParams

NO_BIAS: BiasTable = ((), (), ())


@dataclasses.dataclass(slots=True, kw_only=True)
class ScheduledSeq:
    """One sequence's share of a step: `num_tokens` tokens at positions start, start + 1, ...

    Built by the scheduler and read-only afterwards (a slotted dataclass, not frozen: a step builds
    hundreds, and frozen construction costs twice as much)."""
    key: int  # the request (choice) it advances: `Request.key`
    epoch: int  # the request's epoch when planned: samples for an older epoch are discarded
    slot: int  # its row in the page table and in the sampler state
    start: int
    num_tokens: int
    token_ids: tuple[int, ...] | None  # the span's tokens; None: one token, the previous step's `prev_row`
    prev_row: int = -1
    new_pages: tuple[int, ...] = ()  # pages to append to the slot's page-table row
    new_in_slot: bool = False  # the slot's page-table row starts over (a new occupant, or re-admitted)
    first_chunk: bool = False  # its first chunk since admission: its sampler-state row starts over
    is_prefill: bool = False
    # Index among the request's outputs of the first token drawn after the span; -1: the span ends mid-prompt
    # and draws nothing.
    sample_step: int = -1
    num_draft_tokens: int = 0  # the span's last tokens are drafts to verify: one draw after each, plus one
    constrained: bool = False  # its draws follow a grammar mask
    num_prompt_tokens: int = 0
    params: SamplingParams | None  # None: a span whose result is not drawn tokens (another output head's)
    seed_words: tuple[int, int] = (0, 0)
    bias: BiasTable = NO_BIAS  # static logit_bias / allowed_token_ids entries
    suppress_ids: tuple[int, ...] = ()  # masked for this draw: EOS and stop tokens before min_tokens
    prompt_targets: tuple[int, ...] | None = None  # prompt logprobs: the prompt token after each span row
    head_setting: int = 0  # the output head's per-sequence input (`HeadState.setting`), for a head that has one
    lora_slot: int = 0  # the device slot of its LoRA adapter; 0: the base model alone
    images: tuple = ()  # the image tokens in its span (`scheduling/images.ImageChunk`): encoder rows to place
    mrope: object = None  # its request's M-RoPE positions (`model/mrope.PromptPositions`, shared); None: index

    @property
    def samples(self) -> bool:
        return self.sample_step >= 0

    @property
    def num_samples(self) -> int:
        """Draws after the span: one per draft token, plus one."""
        return self.num_draft_tokens + 1 if self.samples else 0

    @property
    def draw_index(self) -> int:
        """The seeded sampler's counter for the span's first draw (0 for a span that draws nothing)."""
        return max(self.sample_step, 0)

    @classmethod
    def for_sequence(cls, slot: int, pages: list[int], start: int, token_ids: list[int],
                     params: SamplingParams | None = None, seed: int = 0) -> ScheduledSeq:
        """A span of a sequence no scheduler manages (research, tests): `token_ids` at positions start.. of
        the sequence whose K/V lives in `pages`, in page-table row `slot` (sent whole, as a new occupant);
        the token after them is drawn (greedy unless `params` say otherwise)."""
        from jaxserve.sampling.params import bias_table, seed_words

        params = params or SamplingParams(temperature=0, max_tokens=None)
        end = start + len(token_ids)
        targets = None
        if params.prompt_logprobs is not None:  # every row scores the next token of the span
            targets = tuple(token_ids[1:])
        return cls(key=-1, epoch=0, slot=slot, start=start, num_tokens=len(token_ids), token_ids=tuple(token_ids),
                   new_pages=tuple(pages), new_in_slot=True, first_chunk=True, is_prefill=True, sample_step=0,
                   num_prompt_tokens=end, params=params, seed_words=seed_words(seed), bias=bias_table(params),
                   prompt_targets=targets)


@dataclasses.dataclass
class StepPlan:
    seqs: list[ScheduledSeq]
    num_tokens: int

    @property
    def empty(self) -> bool:
        return not self.seqs

    # Computed once: the runner, the engine, the step timing and the speculator each ask on every step (a
    # scan of the sequences, about a microsecond each on the host's critical path), and a plan is not
    # changed once made.
    @functools.cached_property
    def verifies_drafts(self) -> bool:
        """Some sequence verifies draft tokens (speculative decoding): the step needs its draft rows."""
        return any(seq.num_draft_tokens for seq in self.seqs)

    @functools.cached_property
    def prefill_only(self) -> bool:
        """No sequence decodes: every request in the step is still reading its prompt."""
        return all(seq.is_prefill for seq in self.seqs)

    @classmethod
    def of(cls, seqs: list[ScheduledSeq]) -> StepPlan:
        return cls(list(seqs), sum(seq.num_tokens for seq in seqs))


@dataclasses.dataclass
class SampleLogprobs:
    """A step's log-probability outputs on the host (K = the engine's max_logprobs)."""
    sample_logprob: np.ndarray  # [rows, draws] float32: raw logprob of each drawn token
    sample_rank: np.ndarray  # [rows, draws] int32: its rank, 1 = the most likely
    top_ids: np.ndarray  # [rows, draws, K] int32: the K most likely tokens
    top_logprobs: np.ndarray  # [rows, draws, K] float32
    prompt_logprob: np.ndarray  # [tokens] float32: logprob of each row's prompt target
    prompt_rank: np.ndarray  # [tokens] int32
    prompt_top_ids: np.ndarray  # [tokens, K] int32
    prompt_top_logprobs: np.ndarray  # [tokens, K] float32


@dataclasses.dataclass
class SampledTokens:
    """What one step drew, on the host, by sequence row (the order of `StepPlan.seqs`)."""
    tokens: np.ndarray  # [rows, draws] int32: row r's accepted tokens first (draws = 1 + the most drafts)
    num_accepted: np.ndarray  # [rows] int32: how many of row r's tokens stand; 0 where it drew nothing
    fetch_logprobs: Callable[[], SampleLogprobs] | None = None  # copies them to the host when asked

    @classmethod
    def one_per_row(cls, samples: np.ndarray, step: StepPlan,
                    fetch_logprobs: Callable[[], SampleLogprobs] | None = None) -> SampledTokens:
        """One draw per sequence that samples (no drafts): samples [>= rows] int32, row r for seqs[r]."""
        rows = len(step.seqs)
        accepted = np.fromiter((seq.samples for seq in step.seqs), np.int32, rows)
        return cls(samples[:rows, None], accepted, fetch_logprobs)
