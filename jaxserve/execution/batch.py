"""The device batch of one ragged step: its fields, and how the host fills them from a `StepPlan`.

1. A step holds `T` new tokens (padded to a bucket) of at most `S` sequences, contiguous per sequence
   (`cu_q_lens`). `StepBatch` declares every field with its shape in those dimensions; `BatchLayout`
   fixes them for one (tokens, seqs) bucket pair, and its `Packing` (`jaxserve/packing.py`) derives the
   two flat transfer buffers (int32 and float32) from the declarations: one transfer each per step, and
   one broadcast each to the follower processes of a multi-host run.
2. `BatchBuilder.build` fills the fields from the plan's sequences with numpy, vectorised over them:
   fields that name a per-sequence `source` are copied generically, the ragged ones (positions, KV
   slots, page tables, bias lists) are computed here. It keeps a per-slot mirror of the page tables,
   updated by the page-table changes each step carries, so host work per step follows what changed,
   not context length.
3. Inside the jitted step, `BatchLayout.unpack` slices the buffers back into a `StepBatch` (static
   offsets: free).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxserve.packing import Packing, leaf_at, packed, per_seq, per_token
from jaxserve.sampling.logits import LogitsParams
from jaxserve.sampling.params import ADD_BIAS
from jaxserve.sampling.sampler import SamplingArrays
from jaxserve.scheduling.pages import NULL_PAGE
from jaxserve.scheduling.step import ScheduledSeq, StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    """One step's inputs. Dimensions: T tokens, S sequence rows, Q draw rows, P pages per sequence, B bias
    entries per row, R the sampler-state row of padding (the scratch slot). A new per-sequence input is one
    line here."""
    tokens: jax.Array = per_token()  # [T] int32 new token ids (0 for padding, and where from_prev says otherwise)
    from_prev: jax.Array = per_token(fill=-1)  # [T] int32 row of the previous step's samples; -1: use tokens
    positions: jax.Array = per_token()  # [T] int32 position of each token in its sequence (0 for padding)
    write_index: jax.Array = per_token()  # [T] int32 flat KV slot (page * page_size + offset); padding: null page
    token_kind: jax.Array = per_token()  # [T] int32 0 padding, 1 prompt token, 2 output token (sampler state)
    prompt_target: jax.Array = per_token(fill=-1)  # [T] int32 the prompt token after this one (logprobs); -1: none
    lora_slot: jax.Array = per_token()  # [T] int32 LoRA adapter slot of each token's sequence; 0: none
    cu_q_lens: jax.Array = packed("S+1")  # [S + 1] int32 first token row of each sequence; padding rows are empty
    kv_lens: jax.Array = per_seq()  # [S] int32 tokens in the cache per sequence after this step; 0 for padding
    page_tables: jax.Array = packed("S,P")  # [S, P] int32 page ids per sequence (null page beyond its length)
    # Draw rows (Q of them): one per sequence (its last token's logits), plus one per draft token it verifies
    # (the logits before each draft), contiguous per sequence; a step without drafts has row i = sequence i.
    row_index: jax.Array = packed("Q")  # [Q] int32 token row whose logits the draw reads
    row_seq: jax.Array = packed("Q")  # [Q] int32 the draw's sequence row
    row_pos: jax.Array = packed("Q", fill=-1)  # [Q] int32 its place among its sequence's draws; -1: padding
    row_draft: jax.Array = packed("Q", fill=-1)  # [Q] int32 the draft token the draw verifies; -1: none
    slots: jax.Array = per_seq(fill="R", source="slot")  # [S] int32 sampler-state row (padding: the scratch row)
    fresh: jax.Array = per_seq(source="first_chunk")  # [S] int32 1 where that row's state starts over
    # [S] int32 top logprobs wanted for the drawn token; -1: none at all
    logprobs: jax.Array = per_seq(fill=-1, source=lambda seq: -1 if seq.params.logprobs is None or not seq.samples
                                  else seq.params.logprobs)
    pooling: jax.Array = per_seq(source="pooling")  # [S] int32 pooling kind (LAST, MEAN, CLS): pooling runner
    constrained: jax.Array = packed("")  # [] int32 1 when some row's draw is limited by a grammar mask
    sampling: SamplingArrays  # [S] rows
    processing: LogitsParams  # [S] rows, filled when some row processes its logits


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """The shapes of one step program: a static argument of the jitted step (hashable, compared by value)."""
    tokens: int  # T: the token bucket
    seqs: int  # S: sequence rows
    max_pages: int  # P
    bias_entries: int  # B: logit-bias / allowed-token entries per row
    scratch_slot: int  # R: the sampler-state row padding rows use (max_num_seqs)
    max_drafts: int = 0  # K: draft tokens a sequence may verify in one step (speculative decoding)

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
        return Packing(StepBatch, {"T": self.tokens, "S": self.seqs, "Q": self.rows, "P": self.max_pages,
                                   "B": self.bias_entries, "R": self.scratch_slot})

    @functools.cached_property
    def sources(self) -> tuple[list, list]:
        """The per-sequence fields the builder copies generically: (always, only when logits are processed)."""
        return self.packing.sourced() + self.packing.sourced("sampling"), self.packing.sourced("processing")

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

    def build(self, step: StepPlan, layout: BatchLayout, constrained: bool = False) -> tuple[np.ndarray, np.ndarray]:
        seqs = step.seqs
        n = len(seqs)
        ints, floats = layout.empty()
        b: StepBatch = layout.packing.views(ints, floats)
        b.constrained[...] = constrained
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
        prompt_lens = np.fromiter((s.num_prompt_tokens for s in seqs), np.int32, n)
        b.token_kind[:total] = np.where(positions < prompt_lens[seq_of], 1, 2)
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
        self._draw_rows(seqs, cu[1:n + 1], b, layout)
        b.page_tables[:n] = self.tables[slots]
        always, processing = layout.sources
        for path, get in always:
            leaf_at(b, path)[:n] = [get(s) for s in seqs]
        if any(s.params.processes_logits for s in seqs):
            b.processing.active[...] = 1
            for path, get in processing:
                leaf_at(b, path)[:n] = [get(s) for s in seqs]
            self._bias_entries(seqs, b.processing)
        for i, seq in enumerate(seqs):
            if seq.prompt_targets:
                b.prompt_target[cu[i]:cu[i] + len(seq.prompt_targets)] = seq.prompt_targets
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
        # a draft needs 2 tokens
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
        b.token_kind[:] = 1
        b.tokens[:] = 1
        b.kv_lens[:n] = lens
        b.fresh[:n] = 1
        rows = np.arange(n * draws)
        b.row_seq[:n * draws] = rows // draws
        b.row_pos[:n * draws] = rows % draws
        b.row_index[:n * draws] = cu[1:n + 1][rows // draws] - draws + rows % draws
        if draws == 2:
            b.row_draft[:n * draws:2] = 1
        if every_option:
            s, p = b.sampling, b.processing
            s.temperature[:n], s.top_k[:n], s.top_p[:n] = 1.0, 8, 0.9
            p.active[...], p.presence[:n], p.repetition[:n] = 1, 0.5, 1.1
            b.constrained[...] = 1
            b.logprobs[:n] = 0  # the drawn token's own logprob
        return ints, floats

    @staticmethod
    def _draw_rows(seqs: list[ScheduledSeq], ends: np.ndarray, b: StepBatch, layout: BatchLayout) -> None:
        """Each sequence's draw rows: its last `drafts + 1` tokens, whose logits decide the token after each."""
        n = len(seqs)
        drafts = np.fromiter((s.num_draft_tokens for s in seqs), np.int32, n)
        if not drafts.any():  # row i is sequence i
            b.row_index[:n] = ends - 1
            b.row_seq[:n] = np.arange(n)
            b.row_pos[:n] = 0
            return
        if drafts.max() > layout.max_drafts:
            raise ValueError(f"a sequence verifies {drafts.max()} draft tokens; the step programs were built for "
                             f"at most {layout.max_drafts} (speculative_config's num_speculative_tokens)")
        counts = drafts + 1
        first = np.cumsum(counts) - counts
        total = int(counts.sum())
        seq_of_row = np.repeat(np.arange(n, dtype=np.int32), counts)
        pos = np.arange(total, dtype=np.int32) - first[seq_of_row]
        b.row_seq[:total] = seq_of_row
        b.row_pos[:total] = pos
        b.row_index[:total] = ends[seq_of_row] - counts[seq_of_row] + pos
        for i in np.flatnonzero(drafts):
            d = int(drafts[i])
            b.row_draft[first[i]:first[i] + d] = seqs[i].token_ids[-d:]

    @staticmethod
    def _bias_entries(seqs: list[ScheduledSeq], p: LogitsParams) -> None:
        """Each row's static bias entries, plus -inf on its EOS and stop tokens while the token being drawn
        is one of its first `min_tokens`."""
        for i, seq in enumerate(seqs):
            ids, values, kinds = seq.bias
            count = len(ids)
            p.bias_ids[i, :count] = ids
            p.bias_values[i, :count] = values
            p.bias_kinds[i, :count] = kinds
            masked = seq.suppress_ids
            if masked:
                p.bias_ids[i, count:count + len(masked)] = masked
                p.bias_values[i, count:count + len(masked)] = -np.inf
                p.bias_kinds[i, count:count + len(masked)] = ADD_BIAS
