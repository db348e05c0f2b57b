"""XLA options of a GPU engine's step programs: fewer, larger kernels a decode step (issue 52).

XLA:GPU merges two matrix products that read the same activations into one (`dot(x, concat(W1, W2))`, the
concatenation fused into the product's operand, so no weight is copied) only while one of the two moves
fewer bytes than `xla_gpu_dot_merger_threshold_mb` (32 MB by default). Llama-3-8B's q, k and v products
pass it and run as one kernel; gate and up (117 MB of bf16 weights each) did not, and ran as two. Every
product that reads the same input is merged here, whatever its size: one kernel a layer fewer, and the
activations read once.
"""

from __future__ import annotations

# Larger than any weight a device holds: every pair of products over the same input merges.
DOT_MERGER_THRESHOLD_MB = 1 << 20

STEP_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": DOT_MERGER_THRESHOLD_MB}


def compiler_options(platform: str) -> dict:
    """The step programs' compile options on `platform` ("gpu" gets `STEP_OPTIONS`, others nothing)."""
    return dict(STEP_OPTIONS) if platform == "gpu" else {}
