"""Rotary position embeddings in the rotate-half layout Hugging Face checkpoints use.

Inverse frequencies are computed once per model on the host (numpy, float64), including the `llama3`
and `linear` rope scalings; the jitted steps turn positions into cos/sin on the fly (cheap, no table).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        original_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = original_len / low_freq_factor
        high_freq_wavelen = original_len / high_freq_factor
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(in_band, blended, scaled)
    return inv_freq


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """[N] positions -> cos, sin of shape [N, head_dim // 2] in float32 (as transformers computes them)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [N, heads, head_dim], cos/sin [N, head_dim // 2] -> x rotated in the rotate-half layout."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
