"""Attention for the engine's jitted steps: the pure-`jnp` references and the per-platform dispatcher.

The package's `__init__` was missing on this branch, so `from pallas_kernels import ...` failed. The
Pallas kernels themselves are not on this branch: `kernels_for_platform` says so instead of guessing.
"""

from __future__ import annotations

from pallas_kernels.dispatch import ATTENTION_BACKENDS, AttentionBackend, select_attention_backend
from pallas_kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference


def kernels_for_platform(platform: str) -> AttentionBackend:
    raise NotImplementedError(f"Pallas attention kernels for {platform!r} are not part of this build; "
                              "use --attention-backend reference")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "select_attention_backend", "kernels_for_platform",
           "paged_decode_attention_reference", "paged_prefill_attention_reference"]
