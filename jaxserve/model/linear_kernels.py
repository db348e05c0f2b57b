"""Which product a weight-only quantized linear layer runs: XLA's, or a Pallas kernel (issue 52).

1. A `KernelPlan` is chosen at start for each distinct product of the model (jaxserve/engine/kernel_choice.py:
   timed on the device, or forced by `--quantized-matmul`) and set on the `QuantizedLinear`s of that shape.
   It is a static attribute, so it is part of the model's graph: the step programs compiled at warm-up
   embed the choice, and the program cache keys them by it. Nothing is decided while serving.
2. When a step is traced, the layer's row count (a static shape) picks the entry of the plan: the smallest
   row count measured that is at least it. Rows past every measured count (a prefill chunk) take XLA's.
3. `kernel_product` runs the kernel of the plan's flavour on the layer's codes, scales and zero points as the
   layer holds them (pallas_kernels/quantized_matmul_*.py); interpret mode on a CPU (tests).
Layers without a plan (`None`, every CPU engine's default) run `quantized_linear` as before, untouched.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.quantization import QuantizedWeight

FLAVOURS = ("triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    flavour: str  # "triton" (GPU) or "mosaic" (TPU)
    rows: tuple[int, ...]  # ascending row counts, each the top of the range its entry of `kernel` covers
    kernel: tuple[bool, ...]  # per entry of `rows`: the Pallas kernel (True) or XLA's product (False)
    interpret: bool = False  # Pallas interpret mode (a CPU: the engine-level tests)

    def __post_init__(self):
        if self.flavour not in FLAVOURS:
            raise ValueError(f"kernel flavour must be one of {FLAVOURS}, got {self.flavour!r}")
        if len(self.rows) != len(self.kernel) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError(f"a kernel plan needs ascending row counts, one choice each: {self.rows}, {self.kernel}")

    def runs_kernel(self, rows: int) -> bool:
        return next((use for top, use in zip(self.rows, self.kernel) if rows <= top), False)

    @property
    def name(self) -> str:
        return f"pallas-{self.flavour}" + (" (interpret)" if self.interpret else "")


def kernel_product(x: jax.Array, weight: QuantizedWeight, flavour: str, interpret: bool = False,
                   **tiles) -> jax.Array:
    """x [..., K] @ W [K, N] by the Pallas kernel of `flavour`, in x's dtype (`tiles`: the kernel's own tile
    options, for benchmarks; the engine takes its defaults)."""
    if flavour == "triton":
        from pallas_kernels.quantized_matmul_gpu import quantized_matmul_gpu as kernel
    else:
        from pallas_kernels.quantized_matmul_tpu import quantized_matmul_tpu as kernel
    rows = x.reshape(-1, x.shape[-1])
    y = kernel(rows, weight.codes, weight.scales, weight.zeros, interpret=interpret, **tiles)
    return y.reshape(*x.shape[:-1], y.shape[-1])
