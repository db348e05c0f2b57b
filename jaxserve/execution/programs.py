"""A model's step programs as shapes: what each token bucket's program is compiled over.

Built from abstract values alone, so the same programs compile on the serving devices (`runner.py`, which
adds the arrays) and for a slice that is not here (`jaxserve plan`, on compile-only devices):
1. `StepPrograms.build` makes the jitted step (`step_program.jit_step`) for the output head, one
   `BatchLayout` per token bucket, and the `StepState` the step takes donated and returns: the KV cache
   (`KVCache.abstract`), the previous step's samples and the head's state (the draw head's sampler state).
2. `inputs(layout)` is a bucket's program arguments as shapes and shardings (the batch buffers, the grammar
   masks where the head takes them, the LoRA stacks, a vision model's encoder rows); `lower(layout)` lowers it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import CacheConfig, ModelConfig, SamplerConfig, SchedulerConfig
from jaxserve.execution.batch import BatchLayout
from jaxserve.execution.heads.draw import DrawHead
from jaxserve.execution.step_io import OutputHead, StepInputs, StepState
from jaxserve.execution.step_program import jit_step
from jaxserve.loader.placement import ShardedModel
from jaxserve.model.kv_cache import KVCache, QuantizedPages
from jaxserve.scheduling.pages import pages_needed
from pallas_kernels.dispatch import AttentionBackend
from pallas_kernels.kv_quant import SCALE_DTYPE, kv_quant_dtype, scales_shape
from sharding import MeshPlan
from sharding.rules import kv_cache_spec, kv_scales_spec


def abstract(tree):
    """The arrays of `tree` (device arrays, host arrays or shapes already) as shapes, dtypes and shardings:
    what lowering a program needs of them, and what the program cache keys it by."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)


def abstract_kv_cache(model_config: ModelConfig, cache_config: CacheConfig, plan: MeshPlan, dtype,
                      layers_folded: bool) -> KVCache:
    """Each of a stage's layers' K and V pages [pp * num_kv_heads, num_pages, page_size, head_dim]
    (quantized: codes, and their lane-dense scales), as shapes and shardings; one array of every layer's
    block when the layers run under `lax.scan` (`KVCache`)."""
    c = model_config
    shape = (plan.pp * c.num_kv_heads, cache_config.num_pages, cache_config.page_size, c.head_dim)
    page_dtype = kv_quant_dtype(cache_config.kv_cache_dtype)
    pages = jax.ShapeDtypeStruct(shape, page_dtype or dtype, sharding=plan.sharding(kv_cache_spec()))
    if page_dtype is not None:
        scales = jax.ShapeDtypeStruct(scales_shape(*shape[:3]), SCALE_DTYPE, sharding=plan.sharding(kv_scales_spec()))
        pages = QuantizedPages(pages, scales)
    return KVCache.abstract(pages, plan.layers_per_stage, folded=layers_folded)


@dataclasses.dataclass
class StepPrograms:
    step: object  # the jitted step (`jit_step`)
    head: OutputHead
    layouts: dict[int, BatchLayout]  # token bucket -> its program's shapes
    plain_layouts: dict[int, BatchLayout]  # where `layouts` verify drafts: the bucket's steps that verify none
    params: tuple  # the parameters' leaves, abstract
    state: StepState  # abstract
    lora: object  # the LoRA slot stacks, abstract, or None
    mask_words: int  # int32 words of one row's allowed-token bitmask
    image_rows: object = None  # a vision model's `image_rows.EncoderRowsBuilder` (its input's shapes); None: no images

    @property
    def kv_cache(self) -> KVCache:
        return self.state.kv_cache

    @classmethod
    def build(cls, model: ShardedModel, model_config: ModelConfig, cache_config: CacheConfig,
              scheduler_config: SchedulerConfig, attention: AttentionBackend, dtype,
              sampler_config: SamplerConfig = SamplerConfig(), head: OutputHead | None = None, lora_stack=None,
              max_drafts: int = 0, compiler_options: dict | None = None, plain_programs: bool = False,
              image_rows=None) -> "StepPrograms":
        """`model`'s parameters may be arrays or shapes (`loader.abstract.AbstractModel.shapes`); `head`: what
        the steps produce (default: the draw head, `heads/`); `lora_stack`: the
        LoRA slots' stacks (`jaxserve/lora/slots.py`), or None without LoRA; `max_drafts`: draft tokens a
        sequence may verify per step (0: no speculation); `compiler_options`: XLA options of every program;
        `plain_programs`: with `max_drafts`, also a program per bucket for the steps that verify no drafts;
        `image_rows`: a vision model's `EncoderRowsBuilder` (the steps place encoder rows at image tokens, and
        with its `spans` an image's tokens attend to each other)."""
        head = head or DrawHead(sampler_config.max_logprobs)
        plan = model.plan
        max_seqs = scheduler_config.max_num_seqs
        max_pages = pages_needed(scheduler_config.max_model_len, cache_config.page_size)
        # M-RoPE's positions where images are served: a text-only prompt's (all three axes equal) are 1-D RoPE's.
        mrope = image_rows is not None and model_config.mrope_section is not None
        layouts = {b: BatchLayout(b, scheduler_config.seqs_for(b), max_pages, sampler_config.max_logit_bias,
                                  max_seqs, max_drafts, head, mrope) for b in scheduler_config.token_buckets}
        plain = ({b: dataclasses.replace(layout, max_drafts=0) for b, layout in layouts.items()}
                 if max_drafts and plain_programs else {})
        kv = abstract_kv_cache(model_config, cache_config, plan, dtype, layers_folded=model.layer_repeats > 1)
        rep = plan.replicated
        state = StepState(kv, jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=rep),
                          head.abstract_state(max_seqs, model_config.vocab_size, rep))
        lora = None if lora_stack is None else abstract(lora_stack)
        step = jit_step(model, plan, attention, model_config, state, max_seqs, masks=head.takes_masks, lora=lora,
                        compiler_options=compiler_options, images=image_rows is not None,
                        image_spans=image_rows is not None and image_rows.spans)
        return cls(step, head, layouts, plain, tuple(abstract(jax.tree.leaves(model.params))), state, lora,
                   (model_config.vocab_size + 31) // 32, image_rows)

    def inputs(self, layout: BatchLayout) -> tuple:
        """The arguments of `layout`'s program, but for the two static ones (the layout, the logits flag)."""
        ints, floats = layout.empty()
        masks = None
        if self.head.takes_masks:
            masks = jax.ShapeDtypeStruct((layout.seqs, self.mask_words), jnp.int32, sharding=self.state.samples.sharding)
        images = None if self.image_rows is None else self.image_rows.abstract(layout.tokens)
        return self.params, self.state, StepInputs(ints, floats, masks, self.lora, images)

    def lower(self, layout: BatchLayout):
        return self.step.lower(*self.inputs(layout), layout, False)
