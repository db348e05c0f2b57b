"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama decoder with a routed expert MLP.

A step's cost follows its active experts, not all of them:
1. route: router logits `x @ gate` in float32, softmax over every expert, the top k per token, their
   weights renormalised to sum 1 where the family asks (`norm_topk_prob`; Mixtral always);
2. group: the N * k (token, expert) assignments sorted by expert, the tokens' rows gathered in that
   order, so each expert's rows are one contiguous segment (`group_sizes`);
3. the experts' gated MLP over each segment with that expert's weights (`grouped_ffn`: `ragged_dot` on
   TPU and GPU; on CPU, whose `ragged_dot` is a dense product over every expert, a loop over tiles laid
   from each non-empty segment's start, each tile's expert chosen by `lax.switch` among experts held as
   separate arrays (`split_experts`) — docs/models.md has the measurements);
4. combine: every assignment's output times its routing weight, added back to its token's row.
Under tensor parallelism each device holds a slice of every expert's intermediate size: partial sums,
one all-reduce, as for the dense MLP. Which layers are sparse is per-layer data (`sparse_layers`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.model.activations import ACTIVATIONS
from jaxserve.model.decoder import init_decoder
from jaxserve.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm, _linear
from jaxserve.model.parallel import Axis

# Per family: the sparse block's attribute and its experts' tensors (gate, up, down), as checkpoints name
# them (`model.layers.{i}.{block}.experts.{e}.{name}.weight`), so loading maps names one to one.
EXPERT_NAMES = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
TILE_ROWS = 32  # the most rows per tile of the CPU grouped loop (see docs/models.md)
SPLIT_MIN_TILE = 2  # the fewest rows per tile over split experts (`grouped_ffn`)


class Experts(nnx.Module):
    """Every expert's weights stacked on a leading expert axis: gate and up [E, hidden, inter], down
    [E, inter, hidden] (checkpoints hold one tensor per expert; the loader stacks them)."""

    def __init__(self, config: ModelConfig, names: tuple[str, str, str], dtype, rngs: nnx.Rngs):
        c = config
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        shapes = ((c.num_experts, c.hidden_size, c.moe_intermediate_size),) * 2 + (
            (c.num_experts, c.moe_intermediate_size, c.hidden_size),)
        for name, shape in zip(names, shapes):
            setattr(self, name, nnx.Param(init(rngs.params(), shape, dtype)))
        self.names = names

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(getattr(self, name)[...] for name in self.names)


class ExpertWeights(nnx.Module):
    """One expert's weights, arrays of their own: gate and up side by side ([hidden, 2 * inter], one product
    for both) and down ([inter, hidden])."""

    def __init__(self, gate_up: jax.Array, down: jax.Array):
        self.gate_up, self.down = nnx.Param(gate_up), nnx.Param(down)


class SplitExperts(nnx.Module):
    """The experts of an `Experts` module as separate arrays, one `ExpertWeights` each (`split_experts`).

    XLA:CPU copies a slice of a stacked array before a product reads it, so the CPU's tile loop over a
    stack paid a copy of its expert's weights per tile: at one decode token, 8 copies of 3 MB a layer for
    Qwen3-MoE-shaped experts, more time than the products. A tile loop that picks its expert among separate
    arrays with `lax.switch` reads them where they lie, and gate and up side by side make one product
    where there were two (docs/models.md, "Experts as separate arrays")."""

    def __init__(self, experts: Experts, allocate=np.empty):
        """`allocate(shape, dtype)`: the host buffers the weights are copied into, once (the loader passes
        ones a CPU device adopts as they are, `sharding.loading.host_buffer`; others are copied again)."""
        stacks = experts.weights()
        place = stacks[0].sharding  # the stack's one device, as its sharding names it
        place = NamedSharding(place.mesh, P()) if isinstance(place, NamedSharding) else place
        gate, up, down = (np.asarray(w) for w in stacks)  # a CPU array's buffer, not a copy
        inter = gate.shape[-1]
        gate_up = allocate((*gate.shape[:-1], 2 * inter), gate.dtype)
        gate_up[..., :inter], gate_up[..., inter:] = gate, up
        own_down = allocate(down.shape, down.dtype)
        np.copyto(own_down, down)
        self.each = nnx.List([ExpertWeights(jax.device_put(gate_up[e], place), jax.device_put(own_down[e], place))
                              for e in range(len(down))])

    def weights(self) -> tuple[tuple[jax.Array, ...], None, tuple[jax.Array, ...]]:
        """(every expert's gate_up, None: up is inside gate_up, every expert's down)."""
        return (tuple(e.gate_up[...] for e in self.each), None, tuple(e.down[...] for e in self.each))


def split_experts(model: nnx.Module, allocate=np.empty) -> nnx.Module:
    """`model` with every sparse layer's stacked experts replaced in place by a `SplitExperts` (for a CPU
    on one device: the split experts run only in the tiled loop, and partition rules name the stacks).
    Each stack is freed once split when the caller holds no other reference to it."""
    for layer in model.layers:
        moe = getattr(layer, getattr(layer, "ffn_name", ""), None)
        if isinstance(moe, SparseMoE) and isinstance(moe.experts, Experts):
            moe.experts = SplitExperts(moe.experts, allocate)
    return model


class SparseMoE(nnx.Module):
    # The router stays in float under --quantization: a [hidden, experts] matrix is a sliver of the layer's
    # bytes, and rounding its scores would change which experts a token goes to.
    float_linears = ("gate",)

    def __init__(self, config: ModelConfig, names: tuple[str, str, str], dtype, rngs: nnx.Rngs):
        self.gate = _linear(dtype, config.hidden_size, config.num_experts, False, rngs)  # the router
        self.experts = Experts(config, names, dtype, rngs)
        self.top_k, self.normalise, self.hidden_act = (config.num_experts_per_tok, config.norm_topk_prob,
                                                       config.hidden_act)
        self.num_experts = config.num_experts

    def __call__(self, x: jax.Array, tp_axis: Axis = None) -> jax.Array:
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [N, k]
        if self.normalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        w_gate, w_up, w_down = self.experts.weights()
        # Expert parallel: this device holds experts first .. first + local - 1 (whole), and the all-reduce
        # below adds the other devices' experts' outputs.
        first = 0 if tp_axis is None or len(w_gate) == self.num_experts else (
            jax.lax.axis_index(tp_axis) * len(w_gate))
        y = routed_ffn(x, weights.astype(x.dtype), experts, w_gate, w_up, w_down, ACTIVATIONS[self.hidden_act],
                       num_experts=self.num_experts, first_expert=first)
        return y if tp_axis is None else jax.lax.psum(y, tp_axis)


def routed_ffn(x, weights, experts, w_gate, w_up, w_down, act, method: str | None = None,
               num_experts: int | None = None, first_expert=0) -> jax.Array:
    """sum over k of weights[n, k] * expert[experts[n, k]](x[n]): x [N, H], weights / experts [N, k], for
    the experts first_expert .. first_expert + E_local - 1 whose weights are given ([E_local, ...], or a
    sequence of E_local arrays each, with w_up None and gate and up side by side in w_gate: `SplitExperts`)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within
    token = order // k
    local = len(w_gate)
    sizes = jnp.bincount(flat, length=num_experts or local).astype(jnp.int32)
    # The local experts' segments are contiguous: rotate them to the front, compute, rotate back. Rows of
    # other devices' experts come out zero.
    start = (jnp.cumsum(sizes) - sizes)[first_expert]
    local_sizes = jax.lax.dynamic_slice_in_dim(sizes, first_expert, local)
    rows = jnp.roll(x[token], -start, axis=0)
    out = grouped_ffn(rows, local_sizes, w_gate, w_up, w_down, act, method)
    # Rows past the local segments are not defined by every backend's ragged_dot: zero them explicitly.
    out = jnp.where((jnp.arange(out.shape[0]) < jnp.sum(local_sizes))[:, None], out, 0)
    out = jnp.roll(out, start, axis=0)
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(out.astype(x.dtype))


def tile_rows(assignments: int, experts: int) -> int:
    """The CPU loop's rows per tile for a step of `assignments` rows over `experts`. Each tile multiplies
    its rows with one expert's weights, which XLA:CPU first copies out of the stack, so a step costs
    about a weight copy and a product per tile: fewer tiles is what counts, padded rows are cheap.
    While experts get a row or less on average (a decode step of up to E / k tokens), one row per tile;
    above that, twice the average rounded up to a power of two (at most TILE_ROWS), so that most experts'
    segments fit one tile: 16 decode tokens, top 8 of 64 experts, average 2, tiles of 4."""
    if assignments <= experts:
        return 1
    per_expert = -(-assignments // experts)
    return min(TILE_ROWS, 2 << (per_expert - 1).bit_length())


def grouped_ffn(rows, group_sizes, w_gate, w_up, w_down, act, method: str | None = None,
                tile: int | None = None) -> jax.Array:
    """down(act(rows @ gate) * (rows @ up)) with each segment's expert: rows [A, H] sorted by expert,
    group_sizes [E] (summing to A), weights stacked [E, ...] (or sequences of E arrays, gate and up side by side
    in w_gate and w_up None: `SplitExperts`, tiled only) -> [A, H]. `tile`: the CPU loop's rows per tile
    (default `tile_rows`)."""
    split = _held_apart(w_gate)
    method = method or ("tiled" if split or jax.default_backend() == "cpu" else "ragged_dot")
    if method == "ragged_dot" and split:
        raise ValueError("split experts run in the tiled loop (ragged_dot takes stacked weights)")
    if method == "ragged_dot":
        dot = lambda a, w: jax.lax.ragged_dot(a, w, group_sizes)
        return dot(act(dot(rows, w_gate)) * dot(rows, w_up), w_down)
    if method == "tiled":
        tile = tile or tile_rows(rows.shape[0], len(w_gate))
        if split:
            # A one-row product is XLA:CPU's own generated loop, compiled per branch: 64 branches a layer
            # took 1.3 s to compile against 0.3 s at two rows, which ran as fast (docs/models.md).
            tile = max(tile, SPLIT_MIN_TILE)
        return _tiled_ffn(rows, group_sizes, w_gate, w_up, w_down, act, tile)
    raise ValueError(f"grouped_ffn method must be ragged_dot or tiled, got {method!r}")


def _tiled_ffn(rows, group_sizes, w_gate, w_up, w_down, act, tile: int) -> jax.Array:
    """The grouped MLP as a loop over tiles of `tile` rows laid from each expert's segment start: an
    expert of s rows takes ceil(s / tile) tiles and an empty one none, so a decode step reads the weights
    of the experts its tokens chose and nothing else, each once when its segment fits a tile. (Tiles on
    a fixed grid straddle segment boundaries: about twice as many tiles, each a copy of an expert's
    weights, at a few rows per expert; docs/models.md has the measurement.)"""
    a, hidden = rows.shape
    tile = min(tile, a)
    if _held_apart(w_gate):
        branches = [functools.partial(_one_expert, e, act) for e in range(len(w_gate))]
        expert_ffn = lambda g, block: jax.lax.switch(g, branches, block, w_gate, w_up, w_down)
    else:
        expert_ffn = lambda g, block: _one_expert(g, act, block, w_gate, w_up, w_down)
    rows = jnp.pad(rows, ((0, tile), (0, 0)))  # the last tile of the last segment reads past row a - 1
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = (group_sizes + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles)

    def run_tile(p, out):
        g = jnp.searchsorted(tiles_end, p, side="right")  # the expert of tile p
        first = starts[g] + (p - (tiles_end[g] - tiles[g])) * tile
        block = jax.lax.dynamic_slice_in_dim(rows, first, tile)
        y = expert_ffn(g, block)
        mine = (first + jnp.arange(tile) < ends[g])[:, None]  # rows past the segment are the next expert's
        kept = jax.lax.dynamic_slice_in_dim(out, first, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y.astype(out.dtype), kept), first, 0)

    out = jax.lax.fori_loop(0, tiles_end[-1], run_tile, jnp.zeros((a + tile, hidden), rows.dtype))
    return out[:a]


def _held_apart(weights) -> bool:
    """Whether experts' weights come as a sequence of arrays (`SplitExperts`) rather than a stack."""
    return isinstance(weights, (tuple, list))


def _one_expert(e, act, block, w_gate, w_up, w_down) -> jax.Array:
    """Expert e's gated MLP of `block`: a static e picks its own arrays (a `lax.switch` branch), a traced
    one slices the stacks (which XLA:CPU copies). w_up None: w_gate holds gate and up side by side."""
    if w_up is None:
        gate, up = jnp.split(block @ w_gate[e], 2, axis=-1)
        return (act(gate) * up) @ w_down[e]
    return (act(block @ w_gate[e]) * (block @ w_up[e])) @ w_down[e]


class MoEDecoderLayer(nnx.Module):
    """Llama's layer with the MLP of a sparse layer replaced by the routed experts."""

    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        block, names = EXPERT_NAMES[config.model_type]
        self.ffn_name = block if config.sparse_layers[layer] else "mlp"
        ffn = SparseMoE(config, names, dtype, rngs) if config.sparse_layers[layer] else MLP(config, dtype, rngs)
        setattr(self, self.ffn_name, ffn)

    def __call__(self, x, cos, sin, k_pages, v_pages, write_index, attend, tp_axis: Axis = None, lora=None):
        assert lora is None, "LoRA adapters are served on the Llama family only (refused at start)"
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), cos, sin, k_pages, v_pages,
                                             write_index, attend, tp_axis)
        x = x + h
        x = x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x), tp_axis)
        return x, k_pages, v_pages


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        init_decoder(self, config, dtype, rngs, MoEDecoderLayer, RMSNorm)
