"""Ragged paged-attention kernels (Pallas, TPU and GPU) beside their pure-`jnp` implementations.

`kernels_for_platform` binds the kernel of one platform into an `AttentionBackend` whose callable has
exactly the signature of `ragged_paged_attention_reference`:
1. "gpu" / "cuda" / "rocm": the Triton kernel (`ragged_gpu`);
2. "tpu": the Mosaic kernel (`ragged_tpu`);
3. "cpu": one of the two in interpret mode (slow; for tests), chosen by the `cpu_flavour` argument, else
   the env var JAXSERVE_PALLAS_CPU_FLAVOUR ("triton"/"gpu" or "mosaic"/"tpu"), else Triton.
Kernel modules are imported lazily, so importing this package never needs Pallas.
"""

from __future__ import annotations

import functools
import os

from pallas_kernels.blocked import ragged_paged_attention_blocked
from pallas_kernels.dispatch import ATTENTION_BACKENDS, AttentionBackend, select_attention_backend
from pallas_kernels.reference import ragged_paged_attention_reference

CPU_FLAVOUR_ENV = "JAXSERVE_PALLAS_CPU_FLAVOUR"
_FLAVOURS = {"triton": "triton", "gpu": "triton", "mosaic": "mosaic", "tpu": "mosaic"}


def _flavour_backend(flavour: str, interpret: bool) -> AttentionBackend:
    suffix = " (interpret)" if interpret else ""
    if flavour == "triton":
        from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu as kernel
    else:
        from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu as kernel
    name = f"pallas-{flavour}{suffix}"
    ragged = functools.partial(kernel, interpret=interpret)
    return AttentionBackend(name, ragged)


def kernels_for_platform(platform: str, *, cpu_flavour: str | None = None) -> AttentionBackend:
    """The Pallas attention backend for `platform` ("gpu", "cuda", "rocm", "tpu" or "cpu")."""
    platform = platform.lower()
    if platform in ("gpu", "cuda", "rocm"):
        return _flavour_backend("triton", interpret=False)
    if platform == "tpu":
        return _flavour_backend("mosaic", interpret=False)
    if platform == "cpu":
        requested = cpu_flavour or os.environ.get(CPU_FLAVOUR_ENV) or "triton"
        if requested.lower() not in _FLAVOURS:
            raise ValueError(f"Pallas CPU flavour must be one of {sorted(_FLAVOURS)} (argument cpu_flavour or "
                             f"${CPU_FLAVOUR_ENV}), got {requested!r}")
        return _flavour_backend(_FLAVOURS[requested.lower()], interpret=True)
    raise NotImplementedError(f"no Pallas attention kernels for platform {platform!r}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "select_attention_backend", "kernels_for_platform",
           "CPU_FLAVOUR_ENV", "ragged_paged_attention_reference", "ragged_paged_attention_blocked"]
