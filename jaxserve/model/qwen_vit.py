"""Qwen2.5-VL's vision transformer, in pure jnp, with its layout computed on the host.

The images' patch grids decide everything data-dependent (window order, segments, positions); the host
computes it once per batch of images (`vision_layout`, numpy) and the jitted encoder takes it as arrays,
so one compiled program serves any mix of image sizes padded to its patch bucket:
1. patch embedding: each flattened patch [C * T * P * P] (`QwenVLImageProcessor` output, the grid's
   merge_size x merge_size blocks adjacent) projected without bias (the checkpoint's 3-D convolution);
2. window order: merge units (the merge_size^2 patches that become one output token) are reordered so that
   each window of window_tokens x window_tokens units is contiguous (`window_index`); each patch's 2-D
   rotary angles come from its (row, column) in the image: head_dim / 4 frequencies per axis, the row's
   and the column's angles side by side, rotated in the rotate-half layout;
3. blocks: RMSNorm -> attention (one qkv projection; attention within the patch's window, or within its
   whole image on the `fullatt_block_indexes` blocks) -> residual; RMSNorm -> gated SiLU MLP -> residual;
4. merger: RMSNorm, each merge unit's patches concatenated, Linear -> GeLU -> Linear to the text width,
   and the units put back in image order (`restore`): one row per image token, images in order.
Parameter names follow the checkpoint (`visual.blocks.0.attn.qkv`, `visual.merger.mlp.0`; loader/encoders.py).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.activations import ACTIVATIONS
from jaxserve.model.encoder_layers import linear, segment_attention
from jaxserve.model.llama import RMSNorm
from jaxserve.model.rope import apply_rope
from jaxserve.model.siglip import PatchEmbedding
from jaxserve.vision_config import QwenVisionConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VisionLayout:
    """Where each patch of a batch of images goes, for a batch padded to N patches (U = N / merge_unit)."""
    window_index: jax.Array  # [U] int32: the merge unit at each place of window order
    restore: jax.Array  # [U] int32: argsort(window_index), back to image order
    positions: jax.Array  # [N, 2] int32: (row, column) of each patch in its image, in window order
    window_segment: jax.Array  # [N] int32: each patch's window, in window order (padding: -1)
    image_segment: jax.Array  # [N] int32: each patch's image (frame), in window order (padding: -1)


def vision_layout(grids: Sequence[tuple[int, int, int]], config: QwenVisionConfig,
                  num_patches: int | None = None) -> VisionLayout:
    """The layout of images with patch grids `grids` ((t, h, w) each), padded to `num_patches` patches
    (a multiple of merge_unit; default: no padding). numpy arrays, ready to transfer."""
    m, mu, ws = config.spatial_merge_size, config.merge_unit, config.window_tokens
    window_index, window_of_unit, positions, frame_sizes = [], [], [], []
    units = windows = 0
    for t, h, w in grids:
        lh, lw = h // m, w // m
        # Pad the unit grid to whole windows, read it window by window, drop the padding.
        padded = np.full((t, lh + (-lh) % ws, lw + (-lw) % ws), -1, np.int64)
        padded[:, :lh, :lw] = np.arange(t * lh * lw).reshape(t, lh, lw) + units
        nh, nw = padded.shape[1] // ws, padded.shape[2] // ws
        for window in padded.reshape(t, nh, ws, nw, ws).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, ws * ws):
            members = window[window >= 0]
            window_index.extend(members.tolist())
            window_of_unit.extend([windows] * len(members))
            windows += 1
        # Each patch's (row, column), in the processor's order: merge blocks row-major, patches within.
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = lambda a: a.reshape(lh, m, lw, m).transpose(0, 2, 1, 3).reshape(-1)
        positions.append(np.tile(np.stack([block(rows), block(cols)], axis=-1), (t, 1)))
        frame_sizes.extend([h * w] * t)
        units += t * lh * lw
    total = units * mu
    num_patches = total if num_patches is None else num_patches
    if num_patches < total or num_patches % mu:
        raise ValueError(f"{total} patches do not fit a bucket of {num_patches} (a multiple of {mu} is needed)")
    pad_units = num_patches // mu - units
    index = np.concatenate([np.asarray(window_index, np.int64), np.arange(units, units + pad_units)])
    pos = np.concatenate(positions + [np.zeros((num_patches - total, 2), np.int64)])
    pos = pos.reshape(-1, mu, 2)[index].reshape(-1, 2)
    window_segment = np.repeat(np.concatenate([window_of_unit, np.full(pad_units, -1)]), mu)
    # Window order keeps every image (frame) contiguous and in order, so frame boundaries stay put.
    image_segment = np.concatenate([np.repeat(np.arange(len(frame_sizes)), frame_sizes),
                                    np.full(num_patches - total, -1)])
    as32 = lambda a: np.asarray(a, np.int32)
    return VisionLayout(as32(index), as32(np.argsort(index)), as32(pos), as32(window_segment), as32(image_segment))


class VisionRotary:
    """The 2-D rotary embedding: rows and columns each turn head_dim / 4 frequencies."""

    def __init__(self, config: QwenVisionConfig):
        dim = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))

    def __call__(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[N, 2] -> cos, sin [N, head_dim // 2] (row angles, then column angles)."""
        angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(self.inv_freq)[None, None, :]
        angles = angles.reshape(positions.shape[0], -1)
        return jnp.cos(angles), jnp.sin(angles)


class VisionAttention(nnx.Module):
    def __init__(self, c: QwenVisionConfig, dtype, rngs: nnx.Rngs):
        self.qkv = linear(c.hidden_size, 3 * c.hidden_size, dtype, rngs)
        self.proj = linear(c.hidden_size, c.hidden_size, dtype, rngs)
        self.head_dim = c.head_dim

    def __call__(self, x, cos, sin, segments):
        n = x.shape[0]
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(n, 3, -1, self.head_dim), 1, 0)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.proj(segment_attention(q, k, v, segments, self.head_dim ** -0.5).reshape(n, -1))


class VisionMLP(nnx.Module):
    def __init__(self, c: QwenVisionConfig, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(c.hidden_size, c.intermediate_size, dtype, rngs)
        self.up_proj = linear(c.hidden_size, c.intermediate_size, dtype, rngs)
        self.down_proj = linear(c.intermediate_size, c.hidden_size, dtype, rngs)
        self.hidden_act = c.hidden_act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.hidden_act](self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nnx.Module):
    def __init__(self, c: QwenVisionConfig, dtype, rngs: nnx.Rngs):
        self.norm1 = RMSNorm(c.hidden_size, 1e-6, dtype=dtype)
        self.norm2 = RMSNorm(c.hidden_size, 1e-6, dtype=dtype)
        self.attn = VisionAttention(c, dtype, rngs)
        self.mlp = VisionMLP(c, dtype, rngs)

    def __call__(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """merge_unit patches -> one token of the text width (checkpoint: `merger.ln_q`, `merger.mlp.{0,2}`)."""

    def __init__(self, c: QwenVisionConfig, dtype, rngs: nnx.Rngs):
        merged = c.hidden_size * c.merge_unit
        self.ln_q = RMSNorm(c.hidden_size, 1e-6, dtype=dtype)
        self.fc1 = linear(merged, merged, dtype, rngs)
        self.fc2 = linear(merged, c.out_hidden_size, dtype, rngs)
        self.merged = merged

    def __call__(self, x):
        x = self.ln_q(x).reshape(-1, self.merged)
        return self.fc2(ACTIVATIONS["gelu"](self.fc1(x)))


class Qwen25VisionEncoder(nnx.Module):
    """Patches [N, patch_dim] and their `VisionLayout` -> embeddings [N / merge_unit, text hidden], one row
    per image token, images in order (rows of padding patches at the end)."""

    def __init__(self, config: QwenVisionConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.patch_embed = PatchEmbedding(config.patch_dim, config.hidden_size, dtype, rngs, bias=False)
        self.blocks = nnx.List([VisionBlock(config, dtype, rngs) for _ in range(config.depth)])
        self.merger = PatchMerger(config, dtype, rngs)
        self.config = config

    def __call__(self, patches: jax.Array, layout: VisionLayout) -> jax.Array:
        c = self.config
        x = self.patch_embed(patches)
        x = x.reshape(-1, c.merge_unit, c.hidden_size)[layout.window_index].reshape(-1, c.hidden_size)
        cos, sin = VisionRotary(c)(layout.positions)
        for i, block in enumerate(self.blocks):
            segments = layout.image_segment if i in c.fullatt_block_indexes else layout.window_segment
            x = block(x, cos, sin, segments)
        return self.merger(x)[layout.restore]
