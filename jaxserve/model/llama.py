"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one Flax NNX decoder.

The variants differ only in switches carried by `ModelConfig`: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), explicit head_dim, sliding window (Mistral), rope scaling (Llama 3.1), tied embeddings, and
multimodal rotary positions (Qwen2-VL / Qwen2.5-VL's language model: `rope` takes [3, N] positions).

One forward call processes a flat set of N tokens — a prefill chunk of one sequence or one token per
decode slot — and is told where their K/V go and how to attend:
1. embed tokens; per layer: RMSNorm -> q/k/v projections (+bias, +q/k norm) -> RoPE at `positions`;
2. write k/v into the layer's pages at `write_index` (flat page * page_size + offset in the layer's block
   of the cache, `KVCache.for_layer`; padding -> the layer's null page);
3. `attend(q, k_pages, v_pages)` (a closure the runner builds over the chosen attention backend);
4. o_proj, residual, RMSNorm, SwiGLU MLP, residual; final RMSNorm. `logits` applies the LM head.

The pieces (`embed`, `run_layers`, `norm`, `logits`) are also called one by one by the sharded runner,
on parameter shards inside `shard_map`: head counts come from the local shapes, and `tp_axis` names the
tensor-parallel group for the three collectives in `parallel.py` (None = unsharded, as in `__call__`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.lora.delta import LayerLoRA, LoRAInputs, delta, project
from jaxserve.model.kv_cache import KVCache, QuantizedPages, write_kv
from jaxserve.model import layer_loop, parallel, split_k
from jaxserve.model.mrope import mrope_cos_sin
from jaxserve.model.parallel import Axis
from jaxserve.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from jaxserve.model.split_k import DecodeEpilogues

# q [N, H, D], k_pages, v_pages [KVH, P, S, D] -> [N, H, D]
AttendFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back, as the reference implementations do."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def project_group(module: nnx.Module, x: jax.Array, lora: LayerLoRA | None, names: tuple[str, ...]):
    """The projections `names` of `module` over the same x, with their LoRA terms: one product when the
    module holds them fused (`fused_projections`, made by jaxserve/model/feature_major.py), else one each."""
    fused = getattr(module, "fused_projections", None)
    if fused is None or fused.names != names:
        return [project(getattr(module, name), x, lora, name) for name in names]
    return [y if (d := delta(lora, name, x)) is None else y + d for y, name in zip(fused.split(x), names)]


def _linear(cfg_dtype, in_dim: int, out_dim: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(in_dim, out_dim, use_bias=bias, dtype=cfg_dtype, param_dtype=cfg_dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.q_proj = _linear(dtype, c.hidden_size, c.q_size, c.attention_bias, rngs)
        self.k_proj = _linear(dtype, c.hidden_size, c.kv_size, c.attention_bias, rngs)
        self.v_proj = _linear(dtype, c.hidden_size, c.kv_size, c.attention_bias, rngs)
        self.o_proj = _linear(dtype, c.q_size, c.hidden_size, c.o_proj_bias, rngs)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype=dtype)
        self.config = config

    def __call__(self, x, cos, sin, k_pages, v_pages, write_index, attend: AttendFn, tp_axis: Axis = None,
                 lora: LayerLoRA | None = None):
        out, k_pages, v_pages = self.heads(x, cos, sin, k_pages, v_pages, write_index, attend, lora)
        return parallel.row_parallel(self.o_proj, out, tp_axis, delta(lora, "o_proj", out)), k_pages, v_pages

    def heads(self, x, cos, sin, k_pages, v_pages, write_index, attend: AttendFn, lora: LayerLoRA | None = None):
        """Everything before o_proj: the attention output [N, local heads x head_dim] and the written pages."""
        c = self.config
        n = x.shape[0]
        # -1: under tensor parallelism this device holds only its share of the heads.
        qkv = project_group(self, x, lora, ("q_proj", "k_proj", "v_proj"))
        q, k, v = (y.reshape(n, -1, c.head_dim) for y in qkv)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, write_index)
        out = attend(q, k_pages, v_pages)
        return out.reshape(n, -1), k_pages, v_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        c = config
        self.gate_proj = _linear(dtype, c.hidden_size, c.intermediate_size, c.mlp_bias, rngs)
        self.up_proj = _linear(dtype, c.hidden_size, c.intermediate_size, c.mlp_bias, rngs)
        self.down_proj = _linear(dtype, c.intermediate_size, c.hidden_size, c.mlp_bias, rngs)

    def __call__(self, x, tp_axis: Axis = None, lora: LayerLoRA | None = None):
        h = self.hidden(x, lora)
        return parallel.row_parallel(self.down_proj, h, tp_axis, delta(lora, "down_proj", h))

    def hidden(self, x, lora: LayerLoRA | None = None):
        """SiLU(gate) x up: down_proj's input."""
        gate, up = project_group(self, x, lora, ("gate_proj", "up_proj"))
        return jax.nn.silu(gate) * up


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(config, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, cos, sin, k_pages, v_pages, write_index, attend, tp_axis: Axis = None,
                 lora: LayerLoRA | None = None):
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), cos, sin, k_pages, v_pages,
                                             write_index, attend, tp_axis, lora)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), tp_axis, lora)
        return x, k_pages, v_pages

    def fused_call(self, x, normed, cos, sin, k_pages, v_pages, write_index, attend, plan: DecodeEpilogues,
                   next_norm: RMSNorm | None):
        """The layer on one device without LoRA, its products split and each followed by one epilogue kernel
        (split_k.py; q/k/v where they and the pages qualify): x, the residual stream, and `normed`, this layer's
        input norm of it, in; the new residual and `next_norm` of it (None: the stage's last layer) out, with
        the pages."""
        if split_k.takes_qkv(self.self_attn) and not isinstance(k_pages, QuantizedPages):
            out, k_pages, v_pages = split_k.split_attention_heads(plan, self.self_attn, normed, cos, sin, k_pages,
                                                                  v_pages, write_index, attend)
        else:
            out, k_pages, v_pages = self.self_attn.heads(normed, cos, sin, k_pages, v_pages, write_index, attend)
        x, normed = split_k.residual_norm(plan, *split_k.split_partials(self.self_attn.o_proj, out), x,
                                          self.post_attention_layernorm)
        h = self.mlp.hidden(normed)
        x, normed = split_k.residual_norm(plan, *split_k.split_partials(self.mlp.down_proj, h), x, next_norm)
        return x, normed, k_pages, v_pages

    def takes_split(self) -> bool:
        """Whether `fused_call` can run this layer (its o_proj and down_proj products split)."""
        return split_k.takes(self.self_attn.o_proj) and split_k.takes(self.mlp.down_proj)


class LlamaForCausalLM(nnx.Module):
    # > 1: `layers` is one period of layers whose parameters are stacked [layer_repeats, ...], run under
    # lax.scan (jaxserve/model/layer_loop.py; set on the stage model by jaxserve/loader/placement.py's
    # `scan_layers`).
    layer_repeats = 1
    # A GPU engine's decode steps split o_proj and down_proj and fuse their epilogues (split_k.py; set at
    # start by jaxserve/engine/builder.py for a model whose layers all `takes_split`); None everywhere else.
    decode_epilogues: DecodeEpilogues | None = None

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        c = config
        self.config = config
        self.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, dtype, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        if not c.tie_word_embeddings and c.has_lm_head:
            self.lm_head = _linear(dtype, c.hidden_size, c.vocab_size, False, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv_cache: KVCache, write_index: jax.Array,
                 attend: AttendFn) -> tuple[jax.Array, KVCache]:
        """tokens, positions, write_index: [N] int32 -> hidden [N, hidden_size], updated cache."""
        x = self.embed(tokens)
        cos, sin = self.rope(positions)
        x, kv_cache = self.run_layers(x, cos, sin, kv_cache, write_index, attend)
        return self.norm(x), kv_cache

    def embed(self, tokens: jax.Array, tp_axis: Axis = None) -> jax.Array:
        return parallel.embed(self.embed_tokens, tokens, tp_axis)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[N] positions, or [3, N] multimodal ones (a model with `mrope_section`, Qwen2-VL) -> cos, sin."""
        # Host-side numpy at trace time: the frequencies become a constant of the compiled step.
        if positions.ndim == 2:
            return mrope_cos_sin(positions, inverse_frequencies(self.config), self.config.mrope_section)
        return rope_cos_sin(positions, inverse_frequencies(self.config))

    def run_layers(self, x, cos, sin, kv_cache: KVCache, write_index, attend: AttendFn,
                   tp_axis: Axis = None, lora: LoRAInputs | None = None) -> tuple[jax.Array, KVCache]:
        """Every layer of this module (a pipeline stage's block, when sharded) over hidden x [N, hidden],
        unrolled or under `lax.scan` (`layer_repeats`, see layer_loop.py); `lora`: the adapters' stacks
        and each token's slot (jaxserve/lora/delta.py), None without LoRA."""
        if lora is not None and self.layer_repeats > 1:
            lora = lora.stacked()  # indexed by a traced layer under the scan

        def run_layer(i, layer, x, k_pages, v_pages, slots, layer_attend):
            return layer(x, cos, sin, k_pages, v_pages, slots, layer_attend, tp_axis,
                         None if lora is None else lora.layer(i))

        if self._fuses_epilogues(x.shape[0], tp_axis, lora):
            return self._run_fused_layers(x, cos, sin, kv_cache, write_index, attend)
        return layer_loop.run_layers(self.layers, self.layer_repeats, x, kv_cache, write_index, attend, run_layer)

    def _fuses_epilogues(self, rows: int, tp_axis: Axis, lora) -> bool:
        plan = self.decode_epilogues
        return (plan is not None and plan.applies(rows) and lora is None and self.layer_repeats == 1
                and (tp_axis is None or jax.lax.axis_size(tp_axis) == 1))

    def _run_fused_layers(self, x, cos, sin, kv_cache: KVCache, write_index, attend: AttendFn):
        """`run_layers` by `DecoderLayer.fused_call`: the residual stream and its next norm are carried
        together, each layer's down_proj epilogue norming for the next layer (the last one for no layer:
        the final norm stays the step's own)."""
        layers = list(self.layers)

        def run_layer(i, layer, carry, k_pages, v_pages, slots, layer_attend):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            x, normed, k_pages, v_pages = layer.fused_call(*carry, cos, sin, k_pages, v_pages, slots, layer_attend,
                                                           self.decode_epilogues, next_norm)
            return (x, normed), k_pages, v_pages

        carry = (x, layers[0].input_layernorm(x))
        (x, _), kv_cache = layer_loop.run_layers(self.layers, 1, carry, kv_cache, write_index, attend, run_layer)
        return x, kv_cache

    def logits(self, hidden: jax.Array, tp_axis: Axis = None, float32: bool = True) -> jax.Array:
        """hidden [N, hidden_size] -> logits [N, vocab_size]: float32, or with `float32=False` in the LM head's
        own dtype (for a caller that only compares them or converts them itself: a bf16 head's logits are
        half the bytes, and converting them is exact)."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        elif not self.config.has_lm_head:
            raise ValueError("this model was loaded without its LM head (a pooling runner): it has no logits")
        else:
            logits = self.lm_head(hidden)
        logits = parallel.gather_vocab(logits, tp_axis, self.config.vocab_size)
        return logits.astype(jnp.float32) if float32 else logits
