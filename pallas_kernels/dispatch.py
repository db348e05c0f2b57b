"""Pick the attention implementation once, at start, for the platform the engine runs on.

The engine's jitted steps call attention only through an `AttentionBackend`, so model code never changes
per backend:
1. `auto` takes the Pallas kernels on GPU and TPU and the `jnp` reference on CPU.
2. `reference` forces the pure-`jnp` reference everywhere.
3. `pallas` forces the kernels; on CPU they run in Pallas interpret mode (slow, for tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from pallas_kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference

ATTENTION_BACKENDS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str  # what the startup log prints, e.g. "reference (jnp)"
    decode: Callable  # same signature as paged_decode_attention_reference
    prefill: Callable  # same signature as paged_prefill_attention_reference


REFERENCE = AttentionBackend("reference (jnp)", paged_decode_attention_reference,
                             paged_prefill_attention_reference)


def select_attention_backend(requested: str = "auto", platform: str | None = None) -> AttentionBackend:
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    platform = platform or jax.default_backend()
    if requested == "reference" or (requested == "auto" and platform == "cpu"):
        return REFERENCE
    from pallas_kernels import kernels_for_platform  # imported lazily: Pallas is only needed here
    return kernels_for_platform(platform)
