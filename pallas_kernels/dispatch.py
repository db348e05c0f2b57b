"""Pick the attention implementation once, at start, for the platform the engine runs on.

The engine's jitted step calls attention only through an `AttentionBackend`, whose `ragged` callable has
the signature of `ragged_paged_attention_reference`, so model code never changes per backend:
1. `auto` takes the Pallas kernels on GPU and TPU and the blocked `jnp` implementation on CPU (its work
   follows the real KV lengths, see `blocked.py`);
2. `reference` forces the dense `jnp` reference everywhere (the definition of correct; slow);
3. `pallas` forces the kernels; on CPU they run in Pallas interpret mode (slow, for tests).
Every backend takes the contract's optional keyword arguments: quantized pages' `k_scales` / `v_scales`,
and `span_ends`, the per-row bidirectional spans (Gemma 3's image tokens) that widen the causal mask;
left None, each compiles exactly the program it compiles without them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import jax

from pallas_kernels.blocked import ragged_paged_attention_blocked
from pallas_kernels.reference import ragged_paged_attention_reference

ATTENTION_BACKENDS = ("auto", "reference", "pallas")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str  # what the startup log prints, e.g. "blocked (jnp)"
    ragged: Callable  # same signature as ragged_paged_attention_reference (span_ends=None: causal)


REFERENCE = AttentionBackend("reference (jnp, dense)", ragged_paged_attention_reference)
BLOCKED = AttentionBackend("blocked (jnp)", ragged_paged_attention_blocked)
# For step programs whose dots run in Eigen (jaxserve/execution/cpu_matmuls.py): the decode rows' small
# per-sequence products as multiply-and-sum, which stays in YNNPACK's reduce fusions (docs/performance.md).
BLOCKED_MULTIPLY_SUM = AttentionBackend("blocked (jnp, decode products as multiply-and-sum)",
                                        functools.partial(ragged_paged_attention_blocked,
                                                          decode_products="multiply_sum"))


# fp8 (e4m3) KV pages on a GPU: the Triton kernel converts the codes in registers, which Triton lowers for
# compute capability 8.9 and up (Ada, Hopper, Blackwell); compiled for an A100 (8.0) it fails with "cannot
# cast from float8_e4m3fn" (tests/test_compiled_kernels.py compiles it).
FP8_PAGES_MIN_COMPUTE_CAPABILITY = (8, 9)


def check_page_dtype(kv_cache_dtype: str, device) -> None:
    """Refuse, naming the option, KV pages the attention kernels cannot read on `device` (at start, not at
    the first request)."""
    capability = getattr(device, "compute_capability", None)
    if kv_cache_dtype != "fp8" or device.platform != "gpu" or capability is None:
        return
    if tuple(int(x) for x in str(capability).split(".")) < FP8_PAGES_MIN_COMPUTE_CAPABILITY:
        need = ".".join(map(str, FP8_PAGES_MIN_COMPUTE_CAPABILITY))
        raise ValueError(f"--kv-cache-dtype fp8: the {device.device_kind} (compute capability {capability}) cannot "
                         f"run the GPU attention kernel on fp8 pages (it needs {need} or newer: Ada, Hopper, "
                         f"Blackwell); use --kv-cache-dtype int8 (the same bytes a token)")


def select_attention_backend(requested: str = "auto", platform: str | None = None) -> AttentionBackend:
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}")
    platform = platform or jax.default_backend()
    if requested == "reference":
        return REFERENCE
    if requested == "auto" and platform == "cpu":
        return BLOCKED
    return kernels_for_platform(platform)


def for_eigen_dots(backend: AttentionBackend) -> AttentionBackend:
    """The backend to use in step programs compiled with YNNPACK's dot fusions off."""
    return BLOCKED_MULTIPLY_SUM if backend is BLOCKED else backend


CPU_FLAVOUR_ENV = "JAXSERVE_PALLAS_CPU_FLAVOUR"
_FLAVOURS = {"triton": "triton", "gpu": "triton", "mosaic": "mosaic", "tpu": "mosaic"}


def _flavour_backend(flavour: str, interpret: bool) -> AttentionBackend:
    suffix = " (interpret)" if interpret else ""
    # Kernel modules are imported here, lazily: Pallas is only needed once a kernel is chosen.
    if flavour == "triton":
        from pallas_kernels.ragged_gpu import ragged_paged_attention_gpu as kernel
    else:
        from pallas_kernels.ragged_tpu import ragged_paged_attention_tpu as kernel
    name = f"pallas-{flavour}{suffix}"
    ragged = functools.partial(kernel, interpret=interpret)
    return AttentionBackend(name, ragged)


def kernel_flavour(platform: str, cpu_flavour: str | None = None) -> tuple[str, bool]:
    """(flavour, interpret) of the Pallas kernels on `platform` ("gpu", "cuda", "rocm", "tpu" or "cpu"): Triton
    on GPUs, Mosaic on TPUs; on a CPU the `cpu_flavour` argument, else $JAXSERVE_PALLAS_CPU_FLAVOUR, else
    Triton, in interpret mode."""
    platform = platform.lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "triton", False
    if platform == "tpu":
        return "mosaic", False
    if platform == "cpu":
        requested = cpu_flavour or os.environ.get(CPU_FLAVOUR_ENV) or "triton"
        if requested.lower() not in _FLAVOURS:
            raise ValueError(f"Pallas CPU flavour must be one of {sorted(_FLAVOURS)} (argument cpu_flavour or "
                             f"${CPU_FLAVOUR_ENV}), got {requested!r}")
        return _FLAVOURS[requested.lower()], True
    raise NotImplementedError(f"no Pallas kernels for platform {platform!r}")


def kernels_for_platform(platform: str, *, cpu_flavour: str | None = None) -> AttentionBackend:
    """The Pallas attention backend for `platform` ("gpu", "cuda", "rocm", "tpu" or "cpu")."""
    return _flavour_backend(*kernel_flavour(platform, cpu_flavour))
