"""The step program: one pure function `step(params, state, inputs) -> (state, outputs)` (`step_io.py`),
jitted once per (token bucket, logits flag).

1. `jit_step` wraps the body in one `shard_map` over the mesh (even a one-device mesh: one code path) with
   explicit in/out shardings, so nothing recompiles for a sharding it had not seen. The state (KV cache,
   previous samples, the output head's state) is donated: XLA updates it in place.
2. The body (`_step_local`, on each device's shards) unpacks the batch buffers, takes the tokens that are
   still on the device from the previous step's samples, runs every layer over the flat tokens (pipeline
   stages pass microbatches of them along, `sharding/pipeline.py`), writes K/V at their slots and attends
   through the backend's ragged paged attention (a vision model's image rows replace their tokens'
   embeddings first, `image_rows.py`, and its image tokens may see their whole image; Qwen2-VL's rotary
   positions are three per token, `batch.mrope_positions`), then hands the
   hidden states after the final norm to the output head the layout names (`heads/`: the draw head samples and verifies drafts; a serving mode that
   produces something else brings its own head, and nothing here changes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve.execution.batch import BatchLayout, StepBatch
from jaxserve.execution.image_rows import EncoderRows, place_rows
from jaxserve.execution.step_io import StepInputs, StepOutputs, StepState
from jaxserve.lora.delta import LoRAInputs, LoRAStack
from jaxserve.model.kv_cache import attention_operands
from jaxserve.scheduling.pages import NULL_PAGE
from sharding import TP_AXES, MeshPlan
from sharding.pipeline import num_microbatches, run_pipeline


def jit_step(model, plan: MeshPlan, attention, config, state: StepState, rows: int, masks: bool = True,
             lora: LoRAStack | None = None, compiler_options: dict | None = None, images: bool = False,
             image_spans: bool = False):
    """The jitted step over `model`'s parameters, given as a flat tuple of leaves: flattening an nnx.State
    runs Python code for every leaf, on every call, on the critical path of each step. Call it as
    `step(param_leaves, state, inputs, layout, with_logits)`; `state`: the `StepState` as shapes and
    shardings; `rows`: sequence rows of the samples (max_num_seqs); `masks`: the inputs carry grammar masks
    (the output head takes them); `lora`: the LoRA slot stacks (`jaxserve/lora/slots.py`, shaped like the
    given one), or None without LoRA; `compiler_options`: XLA options of every program of the step
    (`cpu_matmuls.py`); `images`: the inputs carry encoder rows (`image_rows.EncoderRows`) placed at the image
    tokens; `image_spans`: an image's tokens attend to each other bidirectionally (Gemma 3)."""
    leaves, param_tree = jax.tree.flatten(model.params)
    rep = plan.replicated
    state_sharding = jax.tree.map(lambda a: a.sharding, state)
    state_specs = jax.tree.map(lambda a: a.sharding.spec, state)
    step_kwargs = dict(graphdef=model.graphdef, attention=attention, config=config, pp=plan.pp, rows=rows,
                       image_spans=image_spans)
    lora_sharding = jax.tree.map(lambda a: a.sharding, lora)
    lora_specs = jax.tree.map(lambda a: a.sharding.spec, lora) if lora is not None else P()
    input_sharding = StepInputs(rep, rep, rep if masks else None, lora_sharding,
                                EncoderRows(rep, rep, rep) if images else None)
    input_specs = StepInputs(P(), P(), P() if masks else None, lora_specs,
                             EncoderRows(P(), P(), P()) if images else None)

    def step(param_leaves, state, inputs, layout, with_logits):
        # check_vma=False: the outputs are replicated by construction (all-reduced or all-gathered,
        # then computed identically on every device); we do not ask JAX to prove it per value.
        local = functools.partial(_step_local, **step_kwargs, layout=layout, with_logits=with_logits)
        params = jax.tree.unflatten(param_tree, param_leaves)
        return jax.shard_map(local, mesh=plan.mesh, in_specs=(model.specs, state_specs, input_specs),
                             out_specs=(state_specs, P()), check_vma=False)(params, state, inputs)

    # Layout and the logits flag are static (one program each) and positional: jit takes no kwargs
    # with in_shardings. The state is donated: updated in place. The LoRA stacks are an input like the
    # weights: loading an adapter into a slot changes their values, not the program.
    return jax.jit(step, static_argnums=(3, 4), donate_argnums=(1,), compiler_options=compiler_options or None,
                   in_shardings=(tuple(a.sharding for a in leaves), state_sharding, input_sharding),
                   out_shardings=(state_sharding, rep))


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


def _step_local(params, state: StepState, inputs: StepInputs, *, graphdef, attention, config, pp, rows: int,
                image_spans: bool, layout: BatchLayout, with_logits: bool):
    model = nnx.merge(graphdef, params)
    batch: StepBatch = layout.unpack(inputs.ints, inputs.floats)
    # Tokens sampled by the previous step that the host has not seen yet come straight from the device.
    tokens = jnp.where(batch.from_prev >= 0, state.samples[jnp.maximum(batch.from_prev, 0)], batch.tokens)
    num_tokens = layout.tokens
    # compare_all: no `while` loop, which would split a GPU step's command buffer (ragged_gpu.work_items).
    seq_of_token = jnp.clip(jnp.searchsorted(batch.cu_q_lens, jnp.arange(num_tokens), side="right",
                                             method="compare_all") - 1, 0, layout.seqs - 1)
    m = num_microbatches(num_tokens, pp)
    size = num_tokens // m
    split = lambda a: a.reshape(m, size)
    micro_tokens, positions, write_index = split(tokens), split(batch.positions), split(batch.write_index)
    if batch.mrope_positions is not None:  # M-RoPE (Qwen2-VL): each microbatch's [3, size] rotary positions
        positions = batch.mrope_positions.reshape(3, m, size).transpose(1, 0, 2)
    lora_slots = split(batch.lora_slot)
    images = inputs.images
    if images is not None:
        row_of_token, span_ends = split(images.row_of_token), split(images.span_ends)

    def stage(x, micro, valid, kv):
        cos, sin = model.rope(positions[micro])
        cu_q_lens, kv_lens = _microbatch_view(batch.cu_q_lens, batch.kv_lens, micro * size, size)

        def attend(q, k_pages, v_pages, first_page, **scoring):
            # A layer may bring its own scoring (Gemma: its window, the query scale, a soft cap); its pages
            # are the block from `first_page` (`KVCache.for_layer`).
            scoring = dict(sm_scale=config.head_dim ** -0.5, sliding_window=config.sliding_window) | scoring
            if image_spans:  # an image token also sees the later tokens of its image
                scoring["span_ends"] = span_ends[micro]
            k_pages, v_pages, scales = attention_operands(k_pages, v_pages)  # quantized pages: + their scales
            return attention.ragged(q, k_pages, v_pages, kv_lens, batch.page_tables + first_page, cu_q_lens,
                                    **scoring, **scales)

        lora_inputs = None if inputs.lora is None else LoRAInputs(inputs.lora, lora_slots[micro])
        return model.run_layers(x, cos, sin, kv, _null_writes(write_index[micro], valid), attend, TP_AXES,
                                lora_inputs)

    def embed(i):
        x = model.embed(micro_tokens[i], TP_AXES)
        return x if images is None else place_rows(x, images.rows, row_of_token[i])

    hidden, kv_cache = run_pipeline(stage, embed, m, state.kv_cache, pp)
    hidden = model.norm(hidden.reshape(num_tokens, -1))
    logits_fn = lambda h, float32=True: model.logits(h, TP_AXES, float32=float32)
    head_state, samples, result = layout.head.run(hidden, logits_fn, batch, state, inputs, layout, rows, tokens,
                                                  seq_of_token)
    logits = model.logits(hidden, TP_AXES) if with_logits else None
    return StepState(kv_cache, samples, head_state), StepOutputs(result, tokens, logits)
