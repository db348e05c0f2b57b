"""The device batch of one ragged step: its fields, and how the host fills them from a `StepPlan`.

1. A step holds `T` new tokens (padded to a bucket) of at most `S` sequences, contiguous per sequence
   (`cu_q_lens`). `StepBatch` declares the fields every step has (tokens, positions, KV slots, page
   tables, adapter slots) with their shapes in those dimensions; the output head's batch class adds its
   own after them (`step_io.OutputHead.batch`: the draw head's draw rows and sampling settings, the pool
   head's pooling kinds). `BatchLayout` fixes the dimensions for one (tokens, seqs) bucket pair and names
   the head, and its `Packing` (`jaxserve/packing.py`) derives the two flat transfer buffers (int32 and
   float32) from the declarations: one transfer each per step, and one broadcast each to the follower
   processes of a multi-host run.
2. `BatchBuilder.build` fills the fields from the plan's sequences with numpy, vectorised over them:
   fields that name a per-sequence `source` are copied generically, the ragged ones (positions, KV
   slots, page tables) are computed here, and the head fills the rest of its own. It keeps a per-slot
   mirror of the page tables, updated by the page-table changes each step carries, so host work per step
   follows what changed, not context length.
3. Inside the jitted step, `BatchLayout.unpack` slices the buffers back into a `StepBatch` (static
   offsets: free).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.packing import Packing, leaf_at, packed, per_seq, per_token
from jaxserve.scheduling.pages import NULL_PAGE
from jaxserve.scheduling.step import ScheduledSeq, StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """The inputs every step has, whatever its head. Dimensions: T tokens, S sequence rows, P pages per
    sequence (and, for a head's fields, Q draw rows, B bias entries per row, R the scratch row of padding).
    A new per-sequence input is one line here, or in the head's batch class."""
    tokens: jax.Array = per_token()  # [T] int32 new token ids (0 for padding, and where from_prev says otherwise)
    from_prev: jax.Array = per_token(fill=-1)  # [T] int32 row of the previous step's samples; -1: use tokens
    positions: jax.Array = per_token()  # [T] int32 position of each token in its sequence (0 for padding)
    write_index: jax.Array = per_token()  # [T] int32 flat KV slot (page * page_size + offset); padding: null page
    lora_slot: jax.Array = per_token()  # [T] int32 LoRA adapter slot of each token's sequence; 0: none
    cu_q_lens: jax.Array = packed("S+1")  # [S + 1] int32 first token row of each sequence; padding rows are empty
    kv_lens: jax.Array = per_seq()  # [S] int32 tokens in the cache per sequence after this step; 0 for padding
    page_tables: jax.Array = packed("S,P")  # [S, P] int32 page ids per sequence (null page beyond its length)
    # [M, T] int32 M-RoPE's (time, row, column) position of each token (M = 3, `BatchLayout.mrope`); None
    # (M = 0) for every other model: `positions` are its rotary positions
    mrope_positions: jax.Array = packed("M,T")


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The shapes of one step program: a static argument of the jitted step (hashable, compared by value)."""
    tokens: int  # T: the token bucket
    seqs: int  # S: sequence rows
    max_pages: int  # P
    bias_entries: int  # B: logit-bias / allowed-token entries per row
    scratch_slot: int  # R: the sampler-state row padding rows use (max_num_seqs)
    max_drafts: int = 0  # K: draft tokens a sequence may verify in one step (speculative decoding)
    head: object = None  # the output head (`step_io.OutputHead`) whose fields follow StepBatch's; None: none
    mrope: bool = False  # the model's rotary positions are multimodal (Qwen2-VL): the batch carries [3, T] of them

    @property
    def batch(self) -> type:
        """The batch class: StepBatch's fields, then the head's."""
        return StepBatch if self.head is None else self.head.batch

    @property
    def draws(self) -> int:
        """Draws per sequence at most: one per draft token, plus one."""
        return self.max_drafts + 1

    @property
    def rows(self) -> int:
        """Q: draw rows. Every draw reads a token's logits, so a step never has more than it has tokens."""
        return min(self.tokens, self.seqs * self.draws)

    @functools.cached_property
    def packing(self) -> Packing:
        return Packing(self.batch, {"T": self.tokens, "S": self.seqs, "Q": self.rows, "P": self.max_pages,
                                    "B": self.bias_entries, "R": self.scratch_slot, "M": 3 if self.mrope else 0})

    @functools.cached_property
    def sources(self) -> list:
        """The top-level per-sequence fields (the head's included) the builder copies generically."""
        return self.packing.sourced()

    def empty(self) -> tuple[np.ndarray, np.ndarray]:
        """A batch with no sequences: every token is padding writing to the null page (warm-up, followers)."""
        return self.packing.empty()

    def unpack(self, ints: jax.Array, floats: jax.Array) -> StepBatch:
        """Inside the jitted step: the buffers as a StepBatch."""
        return self.packing.unpack(ints, floats)


class BatchBuilder:
    """Host side of the step batch; owned by the runner, called from the engine thread only."""

    def __init__(self, max_num_seqs: int, max_pages: int, page_size: int):
        self.max_pages = max_pages
        self.page_size = page_size
        self.tables = np.full((max_num_seqs, max_pages), NULL_PAGE, np.int32)  # each slot's pages
        self._synced = [0] * max_num_seqs  # pages of the slot's occupant copied into its row

    def _sync_pages(self, seq: ScheduledSeq) -> None:
        slot = seq.slot
        if seq.new_in_slot:  # a new occupant (or the same request re-admitted after preemption)
            self.tables[slot] = NULL_PAGE
            self._synced[slot] = 0
        if seq.new_pages:
            done = self._synced[slot]
            self.tables[slot, done:done + len(seq.new_pages)] = seq.new_pages
            self._synced[slot] = done + len(seq.new_pages)

    def build(self, step: StepPlan, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray]:
        seqs = step.seqs
        n = len(seqs)
        ints, floats = layout.empty()
        b: StepBatch = layout.packing.views(ints, floats)
        if not n:
            return ints, floats
        for seq in seqs:
            self._sync_pages(seq)
        lens = np.fromiter((s.num_tokens for s in seqs), np.int32, n)
        starts = np.fromiter((s.start for s in seqs), np.int32, n)
        slots = np.fromiter((s.slot for s in seqs), np.int32, n)
        cu = b.cu_q_lens
        np.cumsum(lens, out=cu[1:n + 1])
        total = int(cu[n])
        cu[n + 1:] = total
        seq_of = np.repeat(np.arange(n), lens)  # the sequence of each real token
        positions = starts[seq_of] + (np.arange(total, dtype=np.int32) - cu[seq_of])
        b.positions[:total] = positions
        pages = self.tables[slots[seq_of], positions // self.page_size]
        b.write_index[:total] = pages * self.page_size + positions % self.page_size
        lora_slots = np.fromiter((s.lora_slot for s in seqs), np.int32, n)
        if lora_slots.any():
            b.lora_slot[:total] = lora_slots[seq_of]
        tokens: list[int] = []
        for seq in seqs:
            if seq.token_ids is None:  # the token is still on the device: the step reads it there
                b.from_prev[len(tokens)] = seq.prev_row
                tokens.append(0)
            else:
                tokens.extend(seq.token_ids)
        b.tokens[:total] = tokens
        b.kv_lens[:n] = starts + lens
        b.page_tables[:n] = self.tables[slots]
        if b.mrope_positions is not None:
            _fill_mrope_positions(b.mrope_positions, seqs, positions, seq_of, cu)
        for path, get in layout.sources:
            leaf_at(b, path)[:n] = [get(s) for s in seqs]
        if layout.head is not None:
            layout.head.fill(b, seqs, layout, seq_of)
        return ints, floats

    def warmup(self, layout: BatchLayout, every_option: bool, verify: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """A batch that only warm-up runs, every sequence in it reading and writing the null page and keeping
        its sampler state in the scratch row, so nothing a request owns is touched. XLA:CPU pays a one-off
        cost the first time a program enters a loop or a branch (5-30 ms a program on stories260K); a batch
        without sequences enters neither the attention's loops nor the sampler's branches, and left that
        cost to the first requests. The two batches enter them all between them:
        - greedy draws of one-token sequences, as many as the bucket has rows (the decode rows' key loop),
          the last taking the tokens left over (a prefill chunk's loops, when the bucket has more tokens);
        - `every_option`: sampled draws with top-k and top-p, penalties, a grammar mask and logprobs, for
          one sequence of every token (a prefill chunk), or, where the programs verify drafts, sequences of
          a draft and the token after it. (Prompt logprobs stay cold: their branch computes every token's
          logits, which takes seconds for a large bucket.)
        `verify` (where the programs verify drafts): greedy sequences of a draft and the token after it, as
        many as the bucket holds, a verify step's shape for timing it (speculative decoding's cost model)."""
        ints, floats = layout.empty()
        b: StepBatch = layout.packing.views(ints, floats)
        # a draft needs 2 tokens (sequence lengths are the batch's; what each row draws, the head's)
        draws = 2 if (every_option or verify) and layout.max_drafts and layout.tokens > 1 else 1
        n = 1 if every_option and draws == 1 else min(layout.seqs, layout.tokens // draws)
        lens = np.full(n, draws, np.int32)
        lens[-1] += layout.tokens - lens.sum()
        cu = b.cu_q_lens
        np.cumsum(lens, out=cu[1:n + 1])
        cu[n + 1:] = layout.tokens
        positions = np.arange(layout.tokens, dtype=np.int32) - np.repeat(cu[:n], lens)
        b.positions[:] = positions
        b.write_index[:] = NULL_PAGE * self.page_size + positions % self.page_size
        b.tokens[:] = 1
        b.kv_lens[:n] = lens
        if b.mrope_positions is not None:
            b.mrope_positions[:] = positions
        if layout.head is not None:
            layout.head.fill_warmup(b, n, draws, every_option)
        return ints, floats


def _fill_mrope_positions(out: np.ndarray, seqs: list[ScheduledSeq], positions: np.ndarray, seq_of: np.ndarray,
                          cu: np.ndarray) -> None:
    """out [3, T]: each token's index + its request's delta on every axis, and the positions of its prompt's
    image region from the request's table (`model/mrope.PromptPositions`; None: a prompt without images)."""
    deltas = np.fromiter((0 if s.mrope is None else s.mrope.delta for s in seqs), np.int32, len(seqs))
    out[:, :len(positions)] = positions + deltas[seq_of]
    for k, seq in enumerate(seqs):
        if seq.mrope is not None:
            seq.mrope.fill(out[:, cu[k]:cu[k + 1]], seq.start)
