"""The step program: one pure function `(params, kv_cache, sampler_state, prev_samples, buffers, masks) ->
(kv_cache, sampler_state, results, logits)`, jitted once per (token bucket, logits flag).

1. `jit_step` wraps the body in one `shard_map` over the mesh (even a one-device mesh: one code path) with
   explicit in/out shardings, so nothing recompiles for a sharding it had not seen. The KV cache and the
   sampler state are donated: XLA updates them in place.
2. The body (`_step_local`, on each device's shards) unpacks the buffers into a `StepBatch`, takes the
   tokens that are still on the device from the previous step's samples, runs every layer over the flat
   tokens (pipeline stages pass microbatches of them along, `sharding/pipeline.py`), writes K/V at their
   slots and attends through the backend's ragged paged attention, then draws each sequence's rows
   (grammar masks, logits processing, sampling, draft verification: `draws.py`). Log-probabilities are
   computed only when some row asked for them. A pooling runner's program stops at the final norm
   instead: it pools one row per sequence (`jaxserve/pooling/device.py`) and samples nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.execution.batch import BatchLayout, StepBatch
from jaxserve.execution.draws import Draws, draw
from jaxserve.lora.delta import LoRAInputs, LoRAStack
from jaxserve.model.kv_cache import KVCache, attention_operands
from jaxserve.pooling.device import pool_rows
from jaxserve.sampling.logits import SamplerState, record_tokens, token_logprobs
from jaxserve.scheduling.pages import NULL_PAGE
from sharding import TP_AXES, MeshPlan
from sharding.pipeline import num_microbatches, run_pipeline


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResults:
    """What one step returns besides the cache (T = the token bucket, K = top logprobs)."""
    draws: Draws  # by sequence row: chunk i of the plan is row i (`draws.py`)
    prompt_logprob: jax.Array  # [T] float32 logprob of each row's `prompt_target` (prompt logprobs)
    prompt_rank: jax.Array  # [T] int32
    prompt_top_ids: jax.Array  # [T, K] int32
    prompt_top_logprobs: jax.Array  # [T, K] float32
    pooled: jax.Array | None = None  # [R, H] float32 each row's pooled hidden states (pooling runner only)


def jit_step(model, plan: MeshPlan, attention, config, kv_abstract: KVCache, sampler_state: SamplerState,
             num_samples: int, top: int, pooling: bool = False, lora: LoRAStack | None = None,
             compiler_options: dict | None = None):
    """The jitted step over `model`'s parameters, given as a flat tuple of leaves: flattening an nnx.State
    runs Python code for every leaf, on every call, on the critical path of each step. Call it as
    `step(param_leaves, kv_cache, sampler_state, prev_samples, ints, floats, masks, lora, layout, with_logits)`;
    `lora`: the LoRA slot stacks (`jaxserve/lora/slots.py`, shaped like the given one), or None without LoRA;
    `compiler_options`: XLA options of every program of the step (`cpu_matmuls.py`)."""
    leaves, param_tree = jax.tree.flatten(model.params)
    rep = plan.replicated
    state_sharding = jax.tree.map(lambda a: a.sharding, sampler_state)
    kv_sharding = jax.tree.map(lambda a: a.sharding, kv_abstract)
    kv_specs = jax.tree.map(lambda a: a.sharding.spec, kv_abstract)
    step_kwargs = dict(graphdef=model.graphdef, attention=attention, config=config, pp=plan.pp,
                       num_samples=num_samples, top=top, pooling=pooling)
    lora_sharding = jax.tree.map(lambda a: a.sharding, lora)
    lora_specs = jax.tree.map(lambda a: a.sharding.spec, lora) if lora is not None else P()

    def step(param_leaves, kv_cache, sampler_state, prev_samples, ints, floats, masks, lora, layout, with_logits):
        # check_vma=False: the outputs are replicated by construction (all-reduced or all-gathered,
        # then computed identically on every device); we do not ask JAX to prove it per value.
        local = functools.partial(_step_local, **step_kwargs, layout=layout, with_logits=with_logits)
        params = jax.tree.unflatten(param_tree, param_leaves)
        return jax.shard_map(local, mesh=plan.mesh,
                             in_specs=(model.specs, kv_specs, P(), P(), P(), P(), P(), lora_specs),
                             out_specs=(kv_specs, P(), P(), P()), check_vma=False)(
            params, kv_cache, sampler_state, prev_samples, ints, floats, masks, lora)

    # Layout and the logits flag are static (one program each) and positional: jit takes no kwargs
    # with in_shardings. The cache and the sampler state are donated: updated in place. The LoRA stacks
    # are an input like the weights: loading an adapter into a slot changes their values, not the program.
    return jax.jit(step, static_argnums=(8, 9), donate_argnums=(1, 2), compiler_options=compiler_options or None,
                   in_shardings=(tuple(a.sharding for a in leaves), kv_sharding, state_sharding, rep, rep, rep, rep,
                                 lora_sharding),
                   out_shardings=(kv_sharding, state_sharding, rep, rep))


# ---- the body of the shard_map: every array here is this device's shard ---------------------------------

def _microbatch_view(cu_q_lens: jax.Array, kv_lens: jax.Array, lo: jax.Array, size: int):
    """The ragged layout as tokens lo .. lo + size - 1 see it: rows outside belong to no sequence, and a
    sequence's tokens after the microbatch are not in the cache yet (later microbatches write them)."""
    cu = jnp.clip(cu_q_lens, lo, lo + size) - lo
    later = jnp.maximum(cu_q_lens[1:] - jnp.maximum(cu_q_lens[:-1], lo + size), 0)
    return cu, kv_lens - later


def _null_writes(write_index: jax.Array, valid: jax.Array) -> jax.Array:
    # A pipeline bubble step computes on filler data: send its K/V to the null page.
    return jnp.where(valid, write_index, NULL_PAGE)


def _step_local(params, kv_cache: KVCache, sampler_state: SamplerState, prev_samples, ints, floats, masks,
                lora: LoRAStack | None, *, graphdef, attention, config, pp, num_samples: int, top: int,
                layout: BatchLayout, with_logits: bool, pooling: bool):
    model = nnx.merge(graphdef, params)
    batch: StepBatch = layout.unpack(ints, floats)
    # Tokens sampled by the previous step that the host has not seen yet come straight from the device.
    tokens = jnp.where(batch.from_prev >= 0, prev_samples[jnp.maximum(batch.from_prev, 0)], batch.tokens)
    num_tokens = layout.tokens
    # compare_all: no `while` loop, which would split a GPU step's command buffer (ragged_gpu.work_items).
    seq_of_token = jnp.clip(jnp.searchsorted(batch.cu_q_lens, jnp.arange(num_tokens), side="right",
                                             method="compare_all") - 1, 0, layout.seqs - 1)
    sampler_state = record_tokens(sampler_state, batch.slots, batch.fresh, batch.slots[seq_of_token], tokens,
                                  batch.token_kind)
    m = num_microbatches(num_tokens, pp)
    size = num_tokens // m
    split = lambda a: a.reshape(m, size)
    micro_tokens, positions, write_index = split(tokens), split(batch.positions), split(batch.write_index)
    lora_slots = split(batch.lora_slot)

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])
        cu_q_lens, kv_lens = _microbatch_view(batch.cu_q_lens, batch.kv_lens, micro * size, size)

        def attend(q, k_pages, v_pages, first_page, **scoring):
            # A layer may bring its own scoring (Gemma: its window, the query scale, a soft cap); its pages
            # are the block from `first_page` (`KVCache.for_layer`).
            scoring = dict(sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window) | scoring
            k_pages, v_pages, scales = attention_operands(k_pages, v_pages)  # quantized pages: + their scales
            return attention.ragged(q, k_pages, v_pages, kv_lens, batch.page_tables + first_page, cu_q_lens,
                                    **scoring, **scales)

        lora_inputs = None if lora is None else LoRAInputs(lora, lora_slots[micro])
        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES,
                                lora_inputs)

    hidden, kv_cache = run_pipeline(stage, lambda i: model.embed(micro_tokens[i], TP_AXES), m, kv_cache, pp)
    hidden = model.norm(hidden.reshape(num_tokens, -1))
    if pooling:  # prefill only: no LM head, nothing drawn
        return kv_cache, sampler_state, _pooled_results(hidden, batch, layout, num_samples, num_tokens, top), None
    draws, sampler_state = draw(lambda h: model.logits(h, TP_AXES, float32=False), hidden, batch, sampler_state, masks, layout,
                                num_samples, top)
    targets = batch.prompt_target
    prompt_lp = _maybe_logprobs(jnp.any(targets >= 0), lambda: model.logits(hidden, TP_AXES),
                                jnp.maximum(targets, 0), top)
    results = StepResults(draws, *prompt_lp)
    logits = model.logits(hidden, TP_AXES) if with_logits else None
    return kv_cache, sampler_state, results, logits


def _pooled_results(hidden, batch: StepBatch, layout: BatchLayout, num_samples: int, num_tokens: int,
                    top: int) -> StepResults:
    zeros, d = jnp.zeros, layout.draws
    nothing_drawn = Draws(zeros(num_samples, jnp.int32), zeros((num_samples, d), jnp.int32), zeros(num_samples, jnp.int32),
                          zeros((num_samples, d), jnp.float32), zeros((num_samples, d), jnp.int32),
                          zeros((num_samples, d, top), jnp.int32), zeros((num_samples, d, top), jnp.float32))
    return StepResults(nothing_drawn, zeros(num_tokens, jnp.float32), zeros(num_tokens, jnp.int32),
                       zeros((num_tokens, top), jnp.int32), zeros((num_tokens, top), jnp.float32),
                       pooled=pool_rows(hidden, batch.cu_q_lens, batch.pooling, num_samples))


def _maybe_logprobs(wanted, logits_fn, chosen, top: int):
    """`token_logprobs` of the logits `logits_fn` gives, computed only when some row wants them (zeros else)."""
    rows = chosen.shape[0]
    skipped = (jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.int32), jnp.zeros((rows, top), jnp.int32),
               jnp.zeros((rows, top), jnp.float32))
    return jax.lax.cond(wanted, lambda: token_logprobs(logits_fn(), chosen, top), lambda: skipped)
