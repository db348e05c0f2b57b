"""Paged-attention kernels (Pallas, TPU and GPU) beside their pure-`jnp` references.

`kernels_for_platform` binds the kernels of one platform into an `AttentionBackend` whose callables have
exactly the reference signatures:
1. "gpu" / "cuda" / "rocm": the Triton kernels (`decode_gpu`, `prefill_gpu`);
2. "tpu": the Mosaic kernels (`decode_tpu`, `prefill_tpu`);
3. "cpu": one of the two flavours in interpret mode (slow; for tests), chosen by the `cpu_flavour`
   argument, else the env var JAXSERVE_PALLAS_CPU_FLAVOUR ("triton"/"gpu" or "mosaic"/"tpu"), else Triton.
Kernel modules are imported lazily, so importing this package never needs Pallas.
"""

from __future__ import annotations

import os

from pallas_kernels.dispatch import ATTENTION_BACKENDS, AttentionBackend, select_attention_backend
from pallas_kernels.reference import paged_decode_attention_reference, paged_prefill_attention_reference

CPU_FLAVOUR_ENV = "JAXSERVE_PALLAS_CPU_FLAVOUR"
_FLAVOURS = {"triton": "triton", "gpu": "triton", "mosaic": "mosaic", "tpu": "mosaic"}


def _bind(decode_impl, prefill_impl, name: str, interpret: bool) -> AttentionBackend:
    def decode(q, k_pages, v_pages, lengths, page_tables, *, sm_scale, soft_cap=None, sliding_window=None):
        return decode_impl(q, k_pages, v_pages, lengths, page_tables, sm_scale=sm_scale, soft_cap=soft_cap,
                           sliding_window=sliding_window, interpret=interpret)

    def prefill(q, k_pages, v_pages, q_start, kv_len, page_table, *, sm_scale, soft_cap=None,
                sliding_window=None):
        return prefill_impl(q, k_pages, v_pages, q_start, kv_len, page_table, sm_scale=sm_scale,
                            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret)

    decode.__doc__ = f"{name} decode; see paged_decode_attention_reference."
    prefill.__doc__ = f"{name} prefill; see paged_prefill_attention_reference."
    return AttentionBackend(name, decode, prefill)


def _flavour_backend(flavour: str, interpret: bool) -> AttentionBackend:
    suffix = " (interpret)" if interpret else ""
    if flavour == "triton":
        from pallas_kernels.decode_gpu import paged_decode_attention_gpu
        from pallas_kernels.prefill_gpu import paged_prefill_attention_gpu
        return _bind(paged_decode_attention_gpu, paged_prefill_attention_gpu, "pallas-triton" + suffix, interpret)
    from pallas_kernels.decode_tpu import paged_decode_attention_tpu
    from pallas_kernels.prefill_tpu import paged_prefill_attention_tpu
    return _bind(paged_decode_attention_tpu, paged_prefill_attention_tpu, "pallas-mosaic" + suffix, interpret)


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
           "CPU_FLAVOUR_ENV", "paged_decode_attention_reference", "paged_prefill_attention_reference"]
