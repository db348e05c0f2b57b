"""The draw head: sampling, logprobs and draft verification (every generating engine's head).

1. Its batch fields (`DrawBatch`) follow the common ones: per token, what the sampler state records and
   which prompt token each row scores (prompt logprobs); per sequence, its sampler-state row and sampling
   settings (logits processing when some row asks for it); its draw rows (one per sequence, plus one per
   draft token it verifies); and whether some draw follows a grammar mask (`StepInputs.masks`).
2. On the device it records the step's tokens in the sampler state (penalties), then draws every row
   and verifies the drafts (`execution/draws.py`); log-probabilities are computed only when some row
   asked for them. Its result is `DrawResults`; the last standing token of each row is the samples the
   next step reads.
3. On the host the engine reads the accepted tokens a step later (`SampledTokens`, one small array, its
   copy started at dispatch; the log-probabilities only when some sequence asked) and hands them to
   `RequestTracker.update_from_output`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.execution.batch import BatchLayout, StepBatch
from jaxserve.execution.draws import Draws, draw
from jaxserve.execution.step_io import OutputHead, StepInputs, StepState, to_host
from jaxserve.packing import leaf_at, packed, per_seq, per_token
from jaxserve.sampling.logits import LogitsParams, SamplerState, record_tokens, token_logprobs
from jaxserve.sampling.params import ADD_BIAS
from jaxserve.sampling.sampler import SamplingArrays
from jaxserve.scheduling.step import SampledTokens, SampleLogprobs, ScheduledSeq, StepPlan


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrawBatch(StepBatch):
    """The draw head's inputs, after StepBatch's: Q draw rows, B bias entries per row, R the sampler-state
    row of padding (the scratch slot)."""
    token_kind: jax.Array = per_token()  # [T] int32 0 padding, 1 prompt token, 2 output token (sampler state)
    prompt_target: jax.Array = per_token(fill=-1)  # [T] int32 the prompt token after this one (logprobs); -1: none
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
    constrained: jax.Array = packed("")  # [] int32 1 when some row's draw is limited by a grammar mask
    sampling: SamplingArrays  # [S] rows
    processing: LogitsParams  # [S] rows, filled when some row processes its logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrawResults:
    """What the draw head returns (T = the token bucket, K = top logprobs)."""
    draws: Draws  # by sequence row: chunk i of the plan is row i (`draws.py`)
    prompt_logprob: jax.Array  # [T] float32 logprob of each row's `prompt_target` (prompt logprobs)
    prompt_rank: jax.Array  # [T] int32
    prompt_top_ids: jax.Array  # [T, K] int32
    prompt_top_logprobs: jax.Array  # [T, K] float32


@functools.cache
def _setting_sources(layout: BatchLayout) -> tuple[list, list]:
    """The per-sequence settings the head copies: (always, only when some row processes its logits)."""
    return layout.packing.sourced("sampling"), layout.packing.sourced("processing")


@dataclasses.dataclass(frozen=True)
class DrawHead(OutputHead):
    top: int  # K: top logprobs a draw or a prompt row may return (`SamplerConfig.max_logprobs`)
    batch = DrawBatch
    takes_masks = True

    def abstract_state(self, rows: int, vocab_size: int, sharding) -> SamplerState:
        shape = (rows + 1, vocab_size)  # per slot, and the padding rows' scratch row
        return SamplerState(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),
                            jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=sharding))

    # ---- host, building a step ------------------------------------------------------------------------

    def fill(self, b: DrawBatch, seqs: list[ScheduledSeq], layout: BatchLayout, seq_of: np.ndarray) -> None:
        n, total = len(seqs), len(seq_of)
        cu = b.cu_q_lens
        prompt_lens = np.fromiter((s.num_prompt_tokens for s in seqs), np.int32, n)
        b.token_kind[:total] = np.where(b.positions[:total] < prompt_lens[seq_of], 1, 2)
        _draw_rows(seqs, cu[1:n + 1], b, layout)
        always, processing = _setting_sources(layout)
        for path, get in always:
            leaf_at(b, path)[:n] = [get(s) for s in seqs]
        if any(s.params.processes_logits for s in seqs):
            b.processing.active[...] = 1
            for path, get in processing:
                leaf_at(b, path)[:n] = [get(s) for s in seqs]
            _bias_entries(seqs, b.processing)
        for i, seq in enumerate(seqs):
            if seq.prompt_targets:
                b.prompt_target[cu[i]:cu[i] + len(seq.prompt_targets)] = seq.prompt_targets
        # The rows the grammar masks (`RequestTracker.grammar_masks`) are sent for.
        b.constrained[...] = any(s.constrained and s.samples for s in seqs)

    def fill_warmup(self, b: DrawBatch, n: int, draws: int, every_option: bool) -> None:
        cu = b.cu_q_lens
        b.token_kind[:] = 1
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

    # ---- device ---------------------------------------------------------------------------------------

    def run(self, hidden, logits_fn, batch: DrawBatch, state: StepState, inputs: StepInputs, layout: BatchLayout,
            rows: int, tokens, seq_of_token):
        sampler_state = record_tokens(state.head, batch.slots, batch.fresh, batch.slots[seq_of_token], tokens,
                                      batch.token_kind)
        # The draws take the LM head's logits in its own dtype (a plain draw samples from them as written).
        draws, sampler_state = draw(lambda h: logits_fn(h, float32=False), hidden, batch, sampler_state, inputs.masks,
                                    layout, rows, self.top)
        targets = batch.prompt_target
        prompt_lp = _maybe_logprobs(jnp.any(targets >= 0), lambda: logits_fn(hidden), jnp.maximum(targets, 0),
                                    self.top)
        return sampler_state, draws.last, DrawResults(draws, *prompt_lp)

    # ---- host, reading a step -------------------------------------------------------------------------

    def copy_to_host(self, result: DrawResults) -> None:
        for out in (result.draws.tokens, result.draws.accepted):
            out.copy_to_host_async()  # the engine reads them next iteration; start the copy now

    def ready(self, result: DrawResults) -> bool:
        return result.draws.accepted.is_ready()

    def read(self, result: DrawResults, step: StepPlan) -> SampledTokens:
        """The accepted tokens of each sequence row (logprobs fetched only when asked for)."""
        rows = len(step.seqs)
        accepted = to_host(result.draws.accepted)[:rows]
        tokens = to_host(result.draws.tokens)[:rows]
        drew = np.fromiter((seq.samples for seq in step.seqs), np.bool_, rows)
        return SampledTokens(tokens, np.where(drew, accepted, 0).astype(np.int32),
                             functools.partial(self.logprobs, result))

    @staticmethod
    def logprobs(result: DrawResults) -> SampleLogprobs:
        r = jax.tree.map(to_host, result)
        d = r.draws
        return SampleLogprobs(d.sample_logprob, d.sample_rank, d.top_ids, d.top_logprobs, r.prompt_logprob,
                              r.prompt_rank, r.prompt_top_ids, r.prompt_top_logprobs)

    def update(self, tracker, step: StepPlan, read: SampledTokens) -> list:
        return tracker.update_from_output(step, read)


def _maybe_logprobs(wanted, logits_fn, chosen, top: int):
    """`token_logprobs` of the logits `logits_fn` gives, computed only when some row wants them (zeros else)."""
    rows = chosen.shape[0]
    skipped = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
               jnp.zeros((rows, top), jnp.float32))
    return jax.lax.cond(wanted, lambda: token_logprobs(logits_fn(), chosen, top), lambda: skipped)


def _draw_rows(seqs: list[ScheduledSeq], ends: np.ndarray, b: DrawBatch, layout: BatchLayout) -> None:
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


def _bias_entries(seqs: list[ScheduledSeq], p: LogitsParams) -> None:
    """Each row's static bias entries, plus -inf on its EOS and stop tokens while the token being drawn is
    one of its first `min_tokens`."""
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
