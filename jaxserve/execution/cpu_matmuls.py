"""Which library runs the matrix products of a step program on a CPU, chosen once per engine.

XLA:CPU hands dots (and reductions) to YNNPACK fusions by default; with YNNPACK's dot fusions off, a dot
goes to XLA's own dot path (Eigen's contraction). Measured on the 2-core development machine
(docs/performance.md, "Matrix products on the CPU"), same process, same greedy tokens:
- the 124.7M model's float32 decode step: 1.2x faster with Eigen at 4 rows and 1.25-1.3x at 16, equal at 1;
  its 512-token prefill the same or faster. Its matmuls are what that step spends its time on.
- stories260K (hidden 64): 1.4x slower with Eigen at 16 rows. Its matmuls are tiny, and attention's many
  small batched products (a few query heads against a block of keys, per sequence) dominate: YNNPACK
  runs those faster.
- int8 x int8 -> int32 products (`--quantization int8`, dynamic strategy): 8x slower without YNNPACK.

On the Intel development machine one layout beat both: weights turned to [out, in] and each few-row
product run as `W @ x.T` in YNNPACK (`ynnpack-feature-major`, jaxserve/model/feature_major.py). The
124.7M model served 1.24x Eigen's output tok/s at 4 streams and 1.36x at 16, the same at 1, with the same
greedy tokens (docs/performance.md, "Feature-major products"). So `auto` takes it for float32 weights from
`EIGEN_FROM_HIDDEN` features up (and per-channel dynamic int8 ones) on one device; Eigen for such float32
weights on a mesh (the turned kernels would need turned partition rules) and from a mapped checkpoint
stored in the model's own layout (whose weights are used where they lie; turning them copies them; a
mapped checkpoint converted on a CPU stores them turned); XLA's default everywhere else. The
library is a compile option of the step programs (part of their cache keys), so it touches nothing else
in the process. Reductions stay in YNNPACK either way: XLA's own emitter ran the attention's
multiply-and-sum formulation 12x slower.

One more choice follows the weights' dtype: XLA:CPU runs a bfloat16 product of one row in its own generated
loop, and from two rows up in YNNPACK's tuned kernels. The 124.7M model's bfloat16 step took 102-108 ms for
one token and 21-22 ms for two (float32: 17.8 and 24 ms; docs/performance.md, "bfloat16 weights on the
CPU"), so bfloat16 engines run a one-token step padded to two tokens (`smallest_token_bucket` in
jaxserve/engine/builder.py).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jaxserve.config import CPU_MATMUL_LIBRARIES, ModelConfig
from jaxserve.model.feature_major import turning_pays

EIGEN_FROM_HIDDEN = 512  # stories260K (64) is faster in YNNPACK, the 124.7M model (768) turned or in Eigen
FEATURE_MAJOR = "ynnpack-feature-major"  # weights [out, in], products W @ x.T (jaxserve/model/feature_major.py)
YNN_FUSION_OPTION = "xla_cpu_experimental_ynn_fusion_type"
# XLA's default list is dots and reductions; this keeps the reductions only.
EIGEN_DOTS = {YNN_FUSION_OPTION: "LIBRARY_FUSION_TYPE_REDUCE"}

logger = logging.getLogger(__name__)


def resolve_cpu_matmuls(choice: str, platform: str, config: ModelConfig, dtype, devices: int = 1,
                        weights_in_place: bool = False, stored_turned: bool = False) -> str | None:
    """'ynnpack', 'eigen' or 'ynnpack-feature-major' on a CPU, None elsewhere (the options do not exist
    there). `devices`: the model's tensor x pipeline parallel size; feature-major layers need one.
    `weights_in_place`: the weights are views of a mapped checkpoint's file (`jaxserve convert --format
    mapped`); `auto` leaves them in place rather than turn them, which would copy the model at every start
    (the 124.7M model: 0.7 s more to start and 1.5x the peak memory; issue 15's start-up targets), unless
    `stored_turned`: the file holds them turned already (`jaxserve convert --format mapped` on a CPU)."""
    if choice not in CPU_MATMUL_LIBRARIES:
        raise ValueError(f"cpu_matmul_library must be one of {', '.join(CPU_MATMUL_LIBRARIES)}, got {choice!r}")
    if platform != "cpu":
        return None
    if choice == "auto":
        float32 = jnp.dtype(dtype) == jnp.float32 and config.linear_quantization is None
        if turning_pays(config, dtype, devices) and (not weights_in_place or stored_turned):
            choice = FEATURE_MAJOR
        else:
            choice = "eigen" if config.hidden_size >= EIGEN_FROM_HIDDEN and float32 else "ynnpack"
    if choice == FEATURE_MAJOR and devices != 1:
        raise ValueError(f"cpu_matmul_library {FEATURE_MAJOR!r} runs on one device, not on {devices}")
    if choice == "eigen" and not _xla_knows_the_option():
        logger.warning("this jaxlib's XLA:CPU has no %s option: matrix products stay in its default library",
                       YNN_FUSION_OPTION)
        return "ynnpack"
    return choice


@functools.cache
def _xla_knows_the_option() -> bool:
    """The option is experimental: a jaxlib without it would refuse every step program, so ask once."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=EIGEN_DOTS).lower(jnp.zeros(2)).compile()
        return True
    except Exception:  # XLA answers an unknown option with INVALID_ARGUMENT
        return False


def compiler_options(library: str | None) -> dict[str, str]:
    """The step programs' compile options for the resolved library."""
    return dict(EIGEN_DOTS) if library == "eigen" else {}


def describe(library: str) -> str:
    """The resolved library as the startup log names it."""
    return {"eigen": "Eigen (YNNPACK for reductions)", "ynnpack": "YNNPACK",
            FEATURE_MAJOR: "YNNPACK, feature-major (weights [out, in], each product W @ x.T)"}[library]
