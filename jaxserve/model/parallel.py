"""Tensor-parallel pieces of the model: the three places where shards have to talk.

Inside the engine's `shard_map`, every parameter is the local shard the partition rules
(`sharding/rules.py`) gave this device, so most of the model runs unchanged on local heads and local
MLP columns. Three operations need the whole tensor-parallel group (`axis`; None = unsharded):
1. `embed`: the embedding is split over the vocabulary; each device looks up the tokens in its range,
   contributes zeros for the rest, and an all-reduce assembles the rows (exact: one non-zero term).
2. `row_parallel`: o_proj and down_proj take split inputs and produce partial sums; an all-reduce adds
   them, and the bias (replicated) is added once, after it.
3. `gather_vocab`: the LM head produces logits for the local vocabulary slice; an all-gather
   concatenates them and zero-padding columns (vocab rounded up to a multiple of tp) are dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Axis = str | tuple[str, ...] | None


def embed(module: nnx.Module, tokens: jax.Array, axis: Axis) -> jax.Array:
    """`module`: an `nnx.Embed`, or a `QuantizedEmbed` (codes and row scales, split over the vocabulary alike)."""
    if axis is None:
        return module(tokens)
    if hasattr(module, "lookup"):
        rows, lookup = module.codes.shape[0], module.lookup
    else:
        (table,) = module.promote_dtype((module.embedding[...],), dtype=module.dtype, inexact=False)
        rows, lookup = table.shape[0], lambda local_rows: jnp.take(table, local_rows, axis=0)
    local = tokens - jax.lax.axis_index(axis) * rows
    inside = (local >= 0) & (local < rows)
    x = lookup(jnp.where(inside, local, 0))
    return jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros_like(x)), axis)


def row_parallel(linear: nnx.Linear, x: jax.Array, axis: Axis, extra: jax.Array | None = None) -> jax.Array:
    """`extra`: a partial sum of the same shape to add before the all-reduce (a LoRA term whose A is split
    like this layer's input), so it costs no collective of its own."""
    if axis is None:
        return linear(x) if extra is None else linear(x) + extra
    bias = linear.bias[...] if linear.bias is not None else None
    # A layer with its own product: a QuantizedLinear (each shard quantizes its own slice of x), or a
    # FeatureMajorLinear.
    if hasattr(linear, "project"):
        y = linear.project(x)
    else:
        x, kernel, bias = linear.promote_dtype((x, linear.kernel[...], bias), dtype=linear.dtype)
        y = linear.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=linear.precision)
    if extra is not None:
        y = y + extra
    y = jax.lax.psum(y, axis)
    return y if bias is None else y + bias


def gather_vocab(logits: jax.Array, axis: Axis, vocab_size: int) -> jax.Array:
    if axis is not None and jax.lax.axis_size(axis) > 1:
        # Gathered as a new leading axis, then moved: gathering along the vocabulary axis itself makes
        # XLA lay the logits out column-major, and every row-wise reduction after it (argmax, softmax)
        # then strides through memory.
        parts = jax.lax.all_gather(logits, axis)  # [tp, ..., local vocab]
        logits = jnp.moveaxis(parts, 0, -2).reshape(*logits.shape[:-1], -1)
    return logits[..., :vocab_size]
