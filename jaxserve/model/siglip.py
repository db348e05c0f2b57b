"""Gemma 3's image encoder: the SigLIP vision tower and the multimodal projector, in pure jnp.

One call maps a batch of preprocessed images to the embeddings that replace their placeholder tokens:
1. patch embedding: each image [3, S, S] cut into (S / P)^2 non-overlapping P x P patches, each flattened in
   (channel, row, column) order and projected (the checkpoint's convolution, stride = kernel, is this
   matmul), plus a learned position embedding per patch;
2. encoder layers: LayerNorm -> multi-head self-attention over all of the image's patches (bidirectional)
   -> residual; LayerNorm -> fc1 -> GeLU (tanh) -> fc2 -> residual; then the post-LayerNorm;
3. projector: the patch grid average-pooled to mm_tokens_per_image tokens (kernel = stride), Gemma's
   RMSNorm (`x * (1 + w)`, the soft-embedding norm), and a matmul into the text model's width.
The output rows go, in order, to the image's run of image tokens; the language model does not scale them
by sqrt(hidden) as it does its token embeddings. Parameter names follow the Hugging Face checkpoint
(`vision_tower.vision_model.encoder.layers.0.self_attn.q_proj`, `multi_modal_projector.*`), so loading
maps names mechanically (`jaxserve/loader/encoders.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.activations import ACTIVATIONS
from jaxserve.model.encoder_layers import LayerNorm, linear, segment_attention
from jaxserve.model.gemma import GemmaRMSNorm
from jaxserve.vision_config import SiglipConfig


class PatchEmbedding(nnx.Module):
    """Flattened patches [..., patch_dim] -> [..., hidden]: a convolution whose stride is its kernel."""

    def __init__(self, patch_dim: int, hidden: int, dtype, rngs: nnx.Rngs, bias: bool = True):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (patch_dim, hidden), dtype) * patch_dim ** -0.5)
        if bias:
            self.bias = nnx.Param(jnp.zeros((hidden,), dtype))

    def __call__(self, patches: jax.Array) -> jax.Array:
        out = patches.astype(self.kernel.dtype) @ self.kernel[...]
        return out + self.bias[...] if hasattr(self, "bias") else out


class SiglipEmbeddings(nnx.Module):
    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.patch_embedding = PatchEmbedding(c.num_channels * c.patch_size ** 2, c.hidden_size, dtype, rngs)
        self.position_embedding = nnx.Embed(c.patches_per_side ** 2, c.hidden_size, dtype=dtype, param_dtype=dtype,
                                            rngs=rngs)
        self.patch_size = c.patch_size

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """[B, C, S, S] -> [B, (S / P)^2, hidden], patches in row-major order."""
        b, ch, s, _ = pixel_values.shape
        p, g = self.patch_size, s // self.patch_size
        patches = pixel_values.reshape(b, ch, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, ch * p * p)
        return self.patch_embedding(patches) + self.position_embedding.embedding[...][None]


class SiglipAttention(nnx.Module):
    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self, name, linear(c.hidden_size, c.hidden_size, dtype, rngs))
        self.head_dim = c.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, _ = x.shape
        q, k, v = (proj(x).reshape(b, n, -1, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, None, self.head_dim ** -0.5).reshape(b, n, -1))


class SiglipMLP(nnx.Module):
    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.fc1 = linear(c.hidden_size, c.intermediate_size, dtype, rngs)
        self.fc2 = linear(c.intermediate_size, c.hidden_size, dtype, rngs)
        self.hidden_act = c.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(ACTIVATIONS[self.hidden_act](self.fc1(x)))


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)
        self.self_attn = SiglipAttention(c, dtype, rngs)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)
        self.mlp = SiglipMLP(c, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nnx.Module):
    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([SiglipEncoderLayer(c, dtype, rngs) for _ in range(c.num_layers)])


class SiglipVisionTower(nnx.Module):
    """SigLIP's vision model without its pooling head (Gemma 3 takes every patch)."""

    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.embeddings = SiglipEmbeddings(c, dtype, rngs)
        self.encoder = SiglipEncoder(c, dtype, rngs)
        self.post_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """[B, C, S, S] -> last hidden state [B, patches, vision hidden]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Gemma3Projector(nnx.Module):
    """Patches -> mm_tokens_per_image tokens of the text model's width."""

    def __init__(self, c: SiglipConfig, dtype, rngs: nnx.Rngs):
        self.mm_input_projection_weight = nnx.Param(
            jax.random.normal(rngs.params(), (c.hidden_size, c.text_hidden_size), dtype) * c.hidden_size ** -0.5)
        self.mm_soft_emb_norm = GemmaRMSNorm(c.hidden_size, c.layer_norm_eps, dtype=dtype)
        self.config = c

    def __call__(self, patches: jax.Array) -> jax.Array:
        """[B, patches, vision hidden] -> [B, mm_tokens_per_image, text hidden]."""
        c = self.config
        b, _, d = patches.shape
        t, k = c.tokens_per_side, c.pool_kernel
        grid = patches.reshape(b, t, k, t, k, d).astype(jnp.float32)  # patch (row, col) = (t_r * k + k_r, ...)
        pooled = jnp.mean(grid, axis=(2, 4)).astype(patches.dtype).reshape(b, t * t, d)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight[...]


class Gemma3VisionEncoder(nnx.Module):
    """Images [B, 3, S, S] (`Gemma3ImageProcessor` output) -> embeddings [B, mm_tokens_per_image, text hidden]."""

    def __init__(self, config: SiglipConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.vision_tower = SiglipVisionTower(config, dtype, rngs)
        self.multi_modal_projector = Gemma3Projector(config, dtype, rngs)
        self.config = config

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        return self.multi_modal_projector(self.vision_tower(pixel_values))
