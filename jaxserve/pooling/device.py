"""Pooling inside the step program: one float32 row per sequence row of the ragged step, fixed shapes.

Each sequence row gets, by its kind, the hidden state of its span's last token (LAST), of its first
(CLS), or the sum over its span (MEAN; the host divides once the whole prompt is in). Padding rows and
tokens contribute nothing, so any mix of kinds and lengths runs the same compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pooling.config import CLS, MEAN


def pool_rows(hidden: jax.Array, cu_q_lens: jax.Array, kinds: jax.Array, num_rows: int) -> jax.Array:
    """hidden [T, H] (after the final norm), cu_q_lens [S + 1], kinds [S] -> pooled [num_rows, H] float32
    (rows past S are zeros)."""
    hidden = hidden.astype(jnp.float32)
    num_tokens, seqs = hidden.shape[0], kinds.shape[0]
    token = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(cu_q_lens, token, side="right") - 1
    # Padding tokens (past the last sequence's span) go to an extra segment that is dropped.
    seq_of_token = jnp.where(token < cu_q_lens[seqs], seq_of_token, seqs)
    sums = jax.ops.segment_sum(hidden, seq_of_token, num_segments=seqs + 1)[:seqs]
    first, last = cu_q_lens[:-1], jnp.maximum(cu_q_lens[1:] - 1, 0)
    picked = hidden[jnp.clip(jnp.where(kinds == CLS, first, last), 0, num_tokens - 1)]
    pooled = jnp.where((kinds == MEAN)[:, None], sums, picked)
    return jnp.zeros((num_rows, hidden.shape[1]), jnp.float32).at[:seqs].set(pooled)
