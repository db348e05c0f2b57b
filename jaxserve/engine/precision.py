"""What the engine computes in, said once at start: the startup log, `/metrics`, and the dtype warnings.

1. `Precision.of(...)` collects, after the weights and the KV cache exist: the weights' dtype (the linear
   layers' codes and the strategy that runs them, when quantized) and bytes on the devices, the KV
   pages' dtype and bytes (per token too, scales included), and the attention kernels.
2. `dtype_warnings` compares what was asked (`--dtype`, `--quantization`) with what the checkpoint stores
   and what will run, so "you wanted INT8, you got FP16" is in the log, not discovered in a profile.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.config import LinearQuantization, ModelConfig
from jaxserve.quantization.weights import device_bytes


@dataclasses.dataclass(frozen=True)
class Precision:
    weights: str  # the float dtype of embeddings, norms, LM head (and of every layer unless quantized)
    linear_codes: str | None  # int8 / fp8 / int4 / uint4 codes of the decoder's linear layers, or None
    linear_strategy: str | None  # how a step runs them (weight_only, dynamic_int8, dynamic_fp8)
    linear_source: str | None  # quantized at load, or the checkpoint's format
    weight_bytes: int  # on the devices, 4-bit codes at half a byte
    kv_cache: str  # the pages' dtype
    kv_cache_bytes: int  # pages and scales, every layer
    kv_token_bytes: int  # one token's K and V in every layer, scales included
    attention: str  # the attention backend's name
    quantized_parts: str | None = None  # "linear layers", "... and LM head" (--quantize-lm-head), ...

    @classmethod
    def of(cls, config: ModelConfig, dtype, params, kv_cache, kv_token_bytes: int, attention: str) -> "Precision":
        spec: LinearQuantization | None = config.linear_quantization
        return cls(weights=jnp.dtype(dtype).name, linear_codes=spec and spec.codes,
                   linear_strategy=spec and spec.strategy, linear_source=spec and spec.source,
                   weight_bytes=sum(device_bytes(a) for a in jax.tree.leaves(params)),
                   kv_cache=jnp.dtype(kv_cache.page_dtype).name, kv_cache_bytes=kv_cache.num_bytes,
                   kv_token_bytes=kv_token_bytes, attention=attention,
                   quantized_parts=spec and spec.quantized_parts)

    def describe(self) -> str:
        linear = (f"{self.quantized_parts} {self.linear_codes} ({self.linear_source}, run {self.linear_strategy}), "
                  f"the rest {self.weights}" if self.linear_codes else self.weights)
        return (f"precision: weights {linear}, {self.weight_bytes / 1e6:.1f} MB; KV cache {self.kv_cache} "
                f"({self.kv_token_bytes} bytes a token), {self.kv_cache_bytes / 1e6:.1f} MB; attention "
                f"{self.attention}")


def dtype_warnings(requested_dtype: str, requested_quantization: str | None, config: ModelConfig, dtype,
                   platform: str, stored: str | None = None) -> list[str]:
    """What differs between what was asked, what the checkpoint stores (`stored`, default config.json's
    dtype: a converted checkpoint's own can differ) and what will run."""
    stored = stored or str(config.torch_dtype).removeprefix("torch.")
    serving = jnp.dtype(dtype).name
    spec = config.linear_quantization
    warnings = []
    if requested_dtype != "auto" and stored != serving and spec is None:
        warnings.append(f"--dtype {requested_dtype}: the checkpoint stores {stored} weights, converted to "
                        f"{serving} at load")
    if spec is not None and requested_quantization is None and requested_dtype != "auto":
        warnings.append(f"--dtype {requested_dtype} applies to the embeddings, norms and LM head only: the "
                        f"checkpoint is pre-quantized ({spec.source}), its linear layers stay {spec.codes}")
    if spec is not None and spec.codes == "fp8" and spec.strategy == "weight_only" and platform == "cpu":
        warnings.append("fp8 weights on a CPU run weight-only (no fp8 arithmetic; 0.15-0.5x float32 in "
                        "docs/quantization.md): --quantization int8 is the fast option here (it re-quantizes "
                        "an fp8 checkpoint's layers to int8 at load)")
    if serving == "float16" and platform == "cpu":
        warnings.append("float16 weights on a CPU: XLA:CPU has no fast float16 products (the 124.7M model's "
                        "alone took 99-129 ms a step against float32's 15-46 ms, docs/performance.md); float32 "
                        "(the default here) or bfloat16 run faster")
    return warnings
