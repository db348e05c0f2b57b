"""The draws of one step, on the device: sample every draw row, verify draft tokens, keep what stands.

A sequence that verifies K draft tokens has K + 1 draw rows (`StepBatch.row_*`): the logits after its
pending token and after each draft. Every row is drawn exactly as a step without drafts would draw that
token: the same grammar mask, logits processing and filters, and the same seeded key (the request's seed
folded with the index of the token being drawn). Then:
1. Draft j stands while every draw before it reproduced its draft: a sequence keeps its draws up to and
   including the first that differs from the draft it verifies (or all K + 1 when every draft matched).
   Greedy rows thus accept the longest prefix matching the target's argmax. A sampled row accepts draft x
   with probability p(x), and on a rejection its draw is the target's draw conditioned on not being x:
   rejection sampling with the residual max(0, p - q) for a one-hot q, the only kind of proposal jaxserve
   makes. Because the draw at each index uses that index's key, a seeded request gives the same tokens
   with and without speculation, whatever shares its batch; a rejected index is drawn again, with the same
   key, by the step that reaches it next.
2. `record_tokens` counted every draft in its slot's output counts when the step read it; the drafts that
   were rejected are taken out again, so the penalties' state holds the accepted tokens only.
3. Results come back per sequence row: the drawn tokens [R, K + 1], how many stand, the last standing one
   (the next step's pending token) and, when some row asked, each draw's log-probabilities.
A step whose sequences verify no drafts (every step with speculation off) takes the branch that draws only
the first S rows, one per sequence: no more work than before draft rows existed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.execution.batch import BatchLayout, StepBatch
from jaxserve.sampling.logits import SamplerState, apply_token_masks, process, token_logprobs
from jaxserve.sampling.sampler import sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draws:
    """What a step drew, by sequence row (R = max_num_seqs rows, D = draws per sequence, K = top logprobs)."""
    last: jax.Array  # [R] int32 the last standing token of each row: the next step's pending token
    tokens: jax.Array  # [R, D] int32 the row's draws; the first `accepted` stand
    accepted: jax.Array  # [R] int32 tokens that stand: accepted drafts + 1 (0 for rows without draws)
    sample_logprob: jax.Array  # [R, D] float32 raw logprob of each draw (rows that asked for logprobs)
    sample_rank: jax.Array  # [R, D] int32 its rank, 1 = the most likely
    top_ids: jax.Array  # [R, D, K] int32
    top_logprobs: jax.Array  # [R, D, K] float32


def draw(logits_fn, hidden: jax.Array, batch: StepBatch, sampler_state: SamplerState, masks: jax.Array,
         layout: BatchLayout, num_rows: int, top: int) -> tuple[Draws, SamplerState]:
    """Draw every row of the step and verify its drafts. `logits_fn(hidden rows) -> raw logits` in any float
    dtype (the LM head's own: the draw converts them to float32 where it computes with them)."""
    if layout.max_drafts == 0:
        return _draw_rows(logits_fn, hidden, batch, sampler_state, masks, layout, num_rows, top, layout.seqs)
    # Draft rows cost an LM head and a sort each: a step that verifies none draws one row per sequence.
    return jax.lax.cond(jnp.any(batch.row_draft >= 0),
                        lambda: _draw_rows(logits_fn, hidden, batch, sampler_state, masks, layout, num_rows, top,
                                           layout.rows),
                        lambda: _draw_rows(logits_fn, hidden, batch, sampler_state, masks, layout, num_rows, top,
                                           layout.seqs))


def _per_row(tree, seq: jax.Array):
    """Per-sequence settings ([S, ...] leaves) gathered for each draw row; scalars stay as they are."""
    return jax.tree.map(lambda a: a[seq] if a.ndim else a, tree)


def _draw_rows(logits_fn, hidden, batch: StepBatch, state: SamplerState, masks, layout: BatchLayout,
               num_rows: int, top: int, rows: int) -> tuple[Draws, SamplerState]:
    seq = batch.row_seq[:rows]
    pos = batch.row_pos[:rows]
    drafts = batch.row_draft[:rows]
    slots = batch.slots[seq]
    row_hidden = hidden[batch.row_index[:rows]]
    sampling = _per_row(batch.sampling, seq)
    sampling = dataclasses.replace(sampling, step=sampling.step + jnp.maximum(pos, 0))
    want_logprobs = jnp.any(batch.logprobs >= 0)
    no_logprobs = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
                   jnp.zeros((rows, top), jnp.float32))

    def processed_draw():
        # The grammar mask comes first: a token it forbids has no probability at all, logprobs included.
        raw = apply_token_masks(logits_fn(row_hidden).astype(jnp.float32), masks[seq], batch.constrained)
        sampled = sample(process(raw, state, slots, _per_row(batch.processing, seq)), sampling)
        return sampled, jax.lax.cond(want_logprobs, lambda: token_logprobs(raw, sampled, top), lambda: no_logprobs)

    # A draw no row masks, processes or asks log-probabilities of (every step of plain requests) has a branch
    # of its own, where the logits go from the LM head straight into the sampler, in the head's dtype (a greedy
    # draw compares them, a sampled one divides them by a float32 temperature). Passed through the other
    # branch's conditionals unchanged, the full-vocabulary logits were converted to float32, materialized and
    # copied twice a step (issue 52).
    plain = (batch.constrained == 0) & (batch.processing.active == 0) & ~want_logprobs
    sampled, lp = jax.lax.cond(plain, lambda: (sample(logits_fn(row_hidden), sampling), no_logprobs),
                               processed_draw)

    # Per sequence, the first draw that does not reproduce its draft: the last one that stands.
    never = layout.draws
    valid = pos >= 0
    misses = jnp.where(valid & (sampled != drafts), pos, never)
    out_row = jnp.where(valid, seq, num_rows)  # padding rows scatter out of range: dropped
    first_miss = jnp.full(num_rows, never, jnp.int32).at[out_row].min(misses, mode="drop")
    accepted = jnp.where(first_miss < never, first_miss + 1, 0)
    at = (out_row, jnp.maximum(pos, 0))
    tokens = jnp.zeros((num_rows, layout.draws), jnp.int32).at[at].set(sampled, mode="drop")
    last = jnp.take_along_axis(tokens, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]

    # Rejected drafts leave the output counts that `record_tokens` put them in.
    scratch = state.output_counts.shape[0] - 1
    rejected = valid & (drafts >= 0) & (pos >= first_miss[jnp.minimum(seq, num_rows - 1)])
    counts = state.output_counts.at[jnp.where(rejected, slots, scratch), jnp.maximum(drafts, 0)].add(-1)
    state = SamplerState(counts.at[scratch].set(0), state.in_prompt)

    per_seq = [jnp.zeros((num_rows, layout.draws) + a.shape[1:], a.dtype).at[at].set(a, mode="drop")
               for a in lp]
    return Draws(last, tokens, accepted, *per_seq), state
