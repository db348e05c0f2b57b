"""The gated MLPs' activations by their Hugging Face config names (`hidden_act` / `hidden_activation`)."""

from __future__ import annotations

import functools

import jax

ACTIVATIONS = {
    "silu": jax.nn.silu,
    # transformers' gelu_pytorch_tanh is the tanh approximation of GeLU.
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # the exact (erf) GeLU: torch's nn.GELU()
}
