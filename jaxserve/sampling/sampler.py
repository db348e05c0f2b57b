"""The sampler on the device: one vectorised draw for every row of a step.

1. `SamplingArrays` holds every row's settings as fixed [rows] arrays (filled from each sequence's
   `SamplingParams` by the batch builder), so any mix of greedy and sampled requests runs the same
   compiled program.
2. `sample` applies temperature, top-k, top-p and min-p per row and draws with a key derived from the
   request's seed and the index of the token being drawn, so a seeded request gives the same tokens
   whatever else shares the batch, and rows with temperature 0 take the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.packing import packed, per_seq


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Every row's sampling settings (S rows); a new setting is one line here (see jaxserve/packing.py)."""
    temperature: jax.Array = per_seq(np.float32, source="params.temperature")  # [S] float32; 0 = greedy
    top_k: jax.Array = per_seq(source="params.top_k")  # [S] int32; 0 = off
    top_p: jax.Array = per_seq(np.float32, fill=1.0, source="params.top_p")  # [S] float32
    min_p: jax.Array = per_seq(np.float32, source="params.min_p")  # [S] float32
    seed: jax.Array = packed("S,2", np.uint32, source="seed_words")  # [S, 2] uint32: the seed's high, low bits
    step: jax.Array = per_seq(source="draw_index")  # [S] int32: index of the token being drawn in its request


def greedy(logits: jax.Array) -> jax.Array:
    """Row-wise argmax (first index of the maximum), [rows, vocab] -> [rows] int32.

    Two plain reductions rather than `jnp.argmax`: XLA's CPU backend runs argmax's (value, index) pair
    reduction about ten times slower, and on CPU it was a tenth of a batched decode step."""
    vocab = logits.shape[-1]
    top = logits.max(axis=-1, keepdims=True)
    index = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(index, vocab - 1)  # a NaN row matches nothing: answer a valid id, not vocab


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits [slots, vocab] (float32, or the LM head's bf16: greedy rows only compare them, sampled ones
    are drawn from them converted to float32) -> token ids [slots] int32."""
    greedy_tokens = greedy(logits)
    # The sort below costs a vocab-sized sort per row: skip it when every row is greedy.
    return jax.lax.cond(jnp.any(params.temperature > 0),
                        lambda: jnp.where(params.temperature > 0, _sample_filtered(logits, params), greedy_tokens),
                        lambda: greedy_tokens)


def _sample_filtered(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    # The filters cost a vocab-sized sort per row: skip it when no row sets one (vLLM's defaults). A row
    # without filters keeps every token on either branch, so what its neighbours ask never changes its draw.
    filtering = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    keep = jax.lax.cond(jnp.any(filtering), lambda: _kept_by_filters(scaled, params),
                        lambda: jnp.ones(scaled.shape, jnp.bool_))
    masked = jnp.where(keep | ~filtering[:, None], scaled, -jnp.inf)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        return jax.random.categorical(key, row)

    return jax.vmap(draw)(params.seed, params.step, masked).astype(jnp.int32)


# Each row's best candidates come from `lax.top_k` instead of a sort of the whole vocabulary whenever they
# provably hold every token the filters keep: at Gemma's 262k tokens the sort was 30x the top_k on CPU.
TOP_K_CANDIDATES = 256


def _kept_by_filters(scaled: jax.Array, params: SamplingArrays) -> jax.Array:
    """[rows, vocab] bool: the tokens top-k, top-p and min-p keep, in token order."""
    candidates = min(TOP_K_CANDIDATES, scaled.shape[-1])
    values, ids = jax.lax.top_k(scaled, candidates)
    probs = jnp.exp(values - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    # A row drops every token past its candidates when its top_k stops within them, when the candidates'
    # mass already reaches its top_p, or when the last candidate is already below its min_p cut.
    closed = ((params.top_k > 0) & (params.top_k <= candidates)) | (
        (params.top_p < 1) & (jnp.sum(probs, axis=-1) >= params.top_p)) | (
        (params.min_p > 0) & (probs[:, -1] < params.min_p * probs[:, 0]))
    filtering = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    return jax.lax.cond(jnp.all(closed | ~filtering) & (candidates < scaled.shape[-1]),
                        lambda: _kept_among(scaled, params, values, ids),
                        lambda: _kept_among(scaled, params, *_sorted(scaled)))


def _sorted(scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = jnp.argsort(-scaled, axis=-1)
    return jnp.take_along_axis(scaled, order, axis=-1), order


def _kept_among(scaled: jax.Array, params: SamplingArrays, sorted_logits: jax.Array, order: jax.Array) -> jax.Array:
    """The filters over each row's best candidates (sorted_logits, their ids `order`: [rows, C], descending);
    probabilities are over the whole vocabulary, so top-p and min-p see the mass outside the candidates."""
    rank = jnp.arange(sorted_logits.shape[-1])[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    probs = jnp.exp(sorted_logits - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is short.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < params.top_p[:, None]
    keep &= probs >= params.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    # Back in token order before the draw: the noise each token gets must follow its id, not its rank. By
    # rank, two near-equal logits that swap places (rounding differs between batch shapes) would swap
    # noise, and a seeded request would draw differently depending on what shares its batch.
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros(scaled.shape, jnp.bool_).at[rows, order].set(keep)
