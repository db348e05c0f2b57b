"""Ragged paged-attention kernels (Pallas, TPU and GPU) beside their pure-`jnp` implementations.

`kernels_for_platform` (in `dispatch.py`) binds the kernel of one platform into an `AttentionBackend`
whose callable has exactly the signature of `ragged_paged_attention_reference`:
1. "gpu" / "cuda" / "rocm": the Triton kernel (`ragged_gpu`);
2. "tpu": the Mosaic kernel (`ragged_tpu`);
3. "cpu": one of the two in interpret mode (slow; for tests), chosen by the `cpu_flavour` argument, else
   the env var JAXSERVE_PALLAS_CPU_FLAVOUR ("triton"/"gpu" or "mosaic"/"tpu"), else Triton.
Kernel modules are imported lazily, so importing this package never needs Pallas.
"""

from __future__ import annotations

from pallas_kernels.blocked import ragged_paged_attention_blocked
from pallas_kernels.dispatch import (ATTENTION_BACKENDS, CPU_FLAVOUR_ENV, AttentionBackend, kernels_for_platform,
                                     select_attention_backend)
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "select_attention_backend", "kernels_for_platform",
           "CPU_FLAVOUR_ENV", "ragged_paged_attention_reference", "ragged_paged_attention_blocked"]
