"""A step's logits between the LM head and the draw: penalties, biases, masks, log-probabilities.

Everything here is per row with fixed shapes, so any mix of settings runs the same compiled program and a
request's tokens do not depend on what shares its batch.
1. `SamplerState` lives on the device and is carried from step to step (donated, like the KV cache). Per
   slot it keeps which vocabulary entries the sequence's prompt holds and how often each occurs in its
   output. `record_tokens` updates it from each step's own input tokens: a slot's first chunk after
   admission clears its row, prompt tokens mark `in_prompt`, output tokens (each decode's input, and
   generated tokens recomputed after a preemption) count in `output_counts`. A sampled token is thus
   counted in the step that feeds it back, before that step samples again.
2. `process` applies, per row: the repetition penalty over prompt and output (a logit above 0 is divided
   by it, one below multiplied: vLLM's and transformers' rule), the presence and frequency penalties over
   the output (OpenAI's rule), then a list of entries per row that either add a bias to a token
   (`logit_bias`, and -inf on EOS and stop tokens until `min_tokens` are out) or allow it (with
   `allowed_token_ids` every token not listed is masked).
3. `apply_token_masks` applies the grammar masks of structured outputs (`grammar.py`) to the raw
   logits, before everything else: a token a grammar forbids has probability zero, in logprobs too.
4. `token_logprobs` gives, from the *raw* logits (vLLM's default: what the model said, before penalties
   and temperature), each chosen token's log-probability and rank and the top K alternatives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.packing import packed, per_seq
from jaxserve.sampling.params import ADD_BIAS, ALLOWED


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplerState:
    output_counts: jax.Array  # [slots + 1, vocab] int32; the last row is scratch for padding rows
    in_prompt: jax.Array  # [slots + 1, vocab] bool


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogitsParams:
    """The per-row processing settings of one step (`S` rows, `B` bias entries per row). The batch builder
    fills them only when some row uses them (`active`); a new per-row setting is one line here."""
    presence: jax.Array = per_seq(np.float32, source="params.presence_penalty")  # [S] float32
    frequency: jax.Array = per_seq(np.float32, source="params.frequency_penalty")  # [S] float32
    # [S] float32, 1 = off
    repetition: jax.Array = per_seq(np.float32, fill=1.0, source="params.repetition_penalty")
    bias_ids: jax.Array = packed("S,B")  # [S, B] int32 token ids
    bias_values: jax.Array = packed("S,B", np.float32)  # [S, B] float32 added where the entry's kind has ADD_BIAS
    bias_kinds: jax.Array = packed("S,B")  # [S, B] int32 bit set: ADD_BIAS, ALLOWED; 0 = unused entry
    # [S] int32 1 where only ALLOWED tokens may be drawn
    restrict: jax.Array = per_seq(source=lambda seq: seq.params.allowed_token_ids is not None)
    active: jax.Array = packed("")  # [] int32 1 when any row uses any of the above (else the step skips it all)


def record_tokens(state: SamplerState, slots: jax.Array, fresh: jax.Array, token_slot: jax.Array,
                  tokens: jax.Array, kinds: jax.Array) -> SamplerState:
    """Clear fresh slots, then mark prompt tokens (kind 1) and count output tokens (kind 2).

    slots/fresh: [S]; token_slot, tokens, kinds: [T] (kind 0: padding, nothing recorded)."""
    scratch = state.output_counts.shape[0] - 1
    cleared = jnp.where(fresh > 0, slots, scratch)
    # Clearing writes whole vocabulary rows (262k for Gemma): only in steps where a sequence is new.
    counts, prompt = jax.lax.cond(
        jnp.any(fresh > 0), lambda: (state.output_counts.at[cleared].set(0), state.in_prompt.at[cleared].set(False)),
        lambda: (state.output_counts, state.in_prompt))
    counts = counts.at[jnp.where(kinds == 2, token_slot, scratch), tokens].add(1)
    prompt = prompt.at[jnp.where(kinds == 1, token_slot, scratch), tokens].set(True)
    # The scratch row collected the padding's updates; leave it clean for the next step.
    return SamplerState(counts.at[scratch].set(0), prompt.at[scratch].set(False))


def process(logits: jax.Array, state: SamplerState, slots: jax.Array, p: LogitsParams) -> jax.Array:
    """logits [S, vocab] float32 -> the logits the sampler draws from; slots [S]: each row's state row."""
    def apply():
        counts = state.output_counts[slots]
        seen = (counts > 0) | state.in_prompt[slots]
        rep = p.repetition[:, None]
        out = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        out = out - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)
        rows = jnp.arange(logits.shape[0])[:, None]
        bias = jnp.where(p.bias_kinds & ADD_BIAS, p.bias_values, 0.0)
        out = out.at[rows, p.bias_ids].add(bias)
        allowed = jnp.zeros(logits.shape, jnp.bool_).at[rows, p.bias_ids].max((p.bias_kinds & ALLOWED) > 0)
        return jnp.where((p.restrict[:, None] > 0) & ~allowed, -jnp.inf, out)

    return jax.lax.cond(p.active > 0, apply, lambda: logits)


def apply_token_masks(logits: jax.Array, masks: jax.Array, constrained: jax.Array) -> jax.Array:
    """Forbid (-inf) every token whose bit is clear: logits [S, vocab], masks [S, ceil(vocab / 32)] int32 with
    token t at bit t % 32 of word t // 32 (llguidance's layout). Skipped when no row is constrained."""
    def apply():
        vocab = logits.shape[-1]
        token = jnp.arange(vocab, dtype=jnp.uint32)
        words = jax.lax.bitcast_convert_type(masks, jnp.uint32)[:, token // 32]
        allowed = (words >> (token % 32)) & 1
        return jnp.where(allowed > 0, logits, -jnp.inf)

    return jax.lax.cond(constrained > 0, apply, lambda: logits)


def token_logprobs(logits: jax.Array, chosen: jax.Array, k: int):
    """Raw logits [N, vocab], chosen ids [N] -> (chosen logprob [N], its rank [N] (1 = most likely),
    top-k ids [N, k], top-k logprobs [N, k])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > picked[:, None], axis=-1).astype(jnp.int32) + 1
    top_values, top_ids = jax.lax.top_k(logprobs, k)
    return picked, rank, top_ids.astype(jnp.int32), top_values
