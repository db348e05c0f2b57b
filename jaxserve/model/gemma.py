"""Gemma 2 and Gemma 3 (text) on the Llama decoder's pieces.

What Gemma changes, all of it switched by `ModelConfig` data, not by separate programs:
1. embed: the looked-up rows are scaled by sqrt(hidden_size), the factor rounded to the model dtype first
   (as transformers does); the tied LM head uses the unscaled table.
2. per layer: Gemma's RMSNorm (`x * (1 + weight)` in float32) in a sandwich around attention and MLP
   (`input` -> attention -> `post_attention`; `pre_feedforward` -> MLP -> `post_feedforward`); the
   layer's kind (`config.layer_types`) picks its sliding window and, on Gemma 3, its RoPE tables (local
   theta on sliding layers, global theta and scaling on full ones); scores are scaled by
   `query_pre_attn_scalar ** -0.5` and soft-capped on Gemma 2; Gemma 3 norms q and k per head.
3. the MLP is gated GeLU-tanh; the final logits are soft-capped on Gemma 2.
Every layer kind runs in the same step program: the options are static per layer of one unrolled graph.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import FULL, SLIDING, ModelConfig
from jaxserve.model import parallel
from jaxserve.model.activations import ACTIVATIONS
from jaxserve.model.decoder import init_decoder
from jaxserve.model.llama import MLP, Attention, LlamaForCausalLM, project_group
from jaxserve.model.parallel import Axis
from jaxserve.model.rope import inverse_frequencies, rope_cos_sin


class GemmaRMSNorm(nnx.Module):
    """RMSNorm whose stored weight is an offset around 1, applied in float32 before the cast back."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedMLP(MLP):
    """down(act(gate(x)) * up(x)) with the config's activation (Llama's MLP is the silu case)."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype, rngs)
        self.hidden_act = config.hidden_act

    def __call__(self, x, tp_axis: Axis = None):
        gate, up = project_group(self, x, None, ("gate_proj", "up_proj"))
        gated = ACTIVATIONS[self.hidden_act](gate) * up
        return parallel.row_parallel(self.down_proj, gated, tp_axis)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        super().__init__(config, dtype, rngs)
        if config.qk_norm:  # Gemma 3: the q/k norms are Gemma norms too
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype)


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        norm = functools.partial(GemmaRMSNorm, config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(config, dtype, rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GatedMLP(config, dtype, rngs)
        self.post_feedforward_layernorm = norm()
        self.kind = config.layer_types[layer]
        # Static per layer (a hashable tuple): the layer's attention options for the backend.
        self.scoring = (("sm_scale", config.attn_scale), ("soft_cap", config.attn_logit_softcap),
                        ("sliding_window", config.layer_window(layer)))

    def __call__(self, x, cos, sin, k_pages, v_pages, write_index, attend, tp_axis: Axis = None, lora=None):
        assert lora is None, "LoRA adapters are served on the Llama family only (refused at start)"
        """cos, sin: {layer kind: [N, head_dim // 2]} (see `GemmaForCausalLM.rope`)."""
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), cos[self.kind], sin[self.kind], k_pages,
                                             v_pages, write_index, functools.partial(attend, **dict(self.scoring)),
                                             tp_axis)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), tp_axis))
        return x, k_pages, v_pages


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        init_decoder(self, config, dtype, rngs, GemmaDecoderLayer, GemmaRMSNorm)

    def embed(self, tokens: jax.Array, tp_axis: Axis = None) -> jax.Array:
        x = super().embed(tokens, tp_axis)
        return x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)

    def rope(self, positions: jax.Array) -> tuple[dict, dict]:
        """cos and sin per layer kind: Gemma 3's sliding layers have their own unscaled base."""
        full = rope_cos_sin(positions, inverse_frequencies(self.config))
        local = full
        if self.config.local_rope_theta is not None:
            local_config = dataclasses.replace(self.config, rope_theta=self.config.local_rope_theta,
                                               rope_scaling=None)
            local = rope_cos_sin(positions, inverse_frequencies(local_config))
        return {FULL: full[0], SLIDING: local[0]}, {FULL: full[1], SLIDING: local[1]}

    def logits(self, hidden: jax.Array, tp_axis: Axis = None, float32: bool = True) -> jax.Array:
        cap = self.config.final_logit_softcap
        if cap is None:
            return super().logits(hidden, tp_axis, float32)
        logits = super().logits(hidden, tp_axis)  # the soft cap is computed in float32 either way
        return cap * jnp.tanh(logits / cap)
