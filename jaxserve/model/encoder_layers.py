"""Pieces the vision encoders share: a LayerNorm as the reference computes it, dense bidirectional
attention within segments, and the linear layers' construction.

Encoders see every token of an image at once (no cache, no causality), so attention is a dense softmax
over the keys of the query's own segment: an image for SigLIP, a window or a whole image for Qwen's ViT.
Segments are data (an id per token), so one compiled program serves any mix of image sizes padded to
its bucket; padding tokens get a segment of their own and never touch real ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def linear(in_dim: int, out_dim: int, dtype, rngs: nnx.Rngs, bias: bool = True) -> nnx.Linear:
    return nnx.Linear(in_dim, out_dim, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class LayerNorm(nnx.Module):
    """LayerNorm in float32 with the two-pass variance (mean of squared deviations), cast back."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None,
                      scale: float) -> jax.Array:
    """Bidirectional attention. q, k, v [..., N, heads, head_dim]; segments [..., N] int32 (a query attends
    the keys of its own segment) or None (all keys) -> [..., N, heads, head_dim]. Scores and softmax in
    float32, the weights cast to v's dtype for the product (as transformers' eager attention)."""
    scores = jnp.einsum("...qhd,...khd->...hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if segments is not None:
        same = segments[..., None, :, None] == segments[..., None, None, :]  # [..., 1, N, N]
        scores = jnp.where(same, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)
