"""Pick the attention implementation once, at start, for the platform the engine runs on.

The engine's jitted step calls attention only through an `AttentionBackend`, whose `ragged` callable has
the signature of `ragged_paged_attention_reference`, so model code never changes per backend:
1. `auto` takes the Pallas kernels on GPU and TPU and the blocked `jnp` implementation on CPU (its work
   follows the real KV lengths, see `blocked.py`);
2. `reference` forces the dense `jnp` reference everywhere (the definition of correct; slow);
3. `pallas` forces the kernels; on CPU they run in Pallas interpret mode (slow, for tests).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from pallas_kernels.blocked import ragged_paged_attention_blocked
from pallas_kernels.reference import ragged_paged_attention_reference

ATTENTION_BACKENDS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str  # what the startup log prints, e.g. "blocked (jnp)"
    ragged: Callable  # same signature as ragged_paged_attention_reference


REFERENCE = AttentionBackend("reference (jnp, dense)", ragged_paged_attention_reference)
BLOCKED = AttentionBackend("blocked (jnp)", ragged_paged_attention_blocked)


def select_attention_backend(requested: str = "auto", platform: str | None = None) -> AttentionBackend:
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    platform = platform or jax.default_backend()
    if requested == "reference":
        return REFERENCE
    if requested == "auto" and platform == "cpu":
        return BLOCKED
    from pallas_kernels import kernels_for_platform  # imported lazily: Pallas is only needed here
    return kernels_for_platform(platform)
