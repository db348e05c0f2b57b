"""Quantization: int8 / fp8 / int4 weights and int8 / fp8 KV pages (issue 27), engine-independent.

The data flow, from a checkpoint to a step:
1. `checkpoints.detect_checkpoint_quantization(config)` reads `quantization_config` from config.json and
   names the format (compressed-tensors int8 / fp8, AWQ or GPTQ int4) or refuses it by name; a float
   checkpoint gives None, and `--quantization int8|fp8` then quantizes at load (`quantize_weight`).
2. Its `read_linear(prefix, get_tensor)` turns one layer's stored tensors into a `QuantizedWeight`:
   codes in our `[in, out]` layout, float32 scales per (input block, output column), zero points for
   asymmetric int4.
3. A step applies it with `quantized_linear(x, weight, strategy)`; `default_strategy(platform, dtype)`
   picks weight-only, dynamic int8 or dynamic fp8 per backend (docs/quantization.md).
4. KV pages: the step writes K/V with `write_kv_quantized` (codes + per-token scales) and the attention
   backends read them with the scales folded in (`pallas_kernels.kv_quant`).
Nothing here imports the engine, so the engine's own layout can change around it.
"""

from __future__ import annotations

from jaxserve.quantization.kv_write import write_kv_quantized
from jaxserve.quantization.linear import STRATEGIES, default_strategy, quantized_linear
from jaxserve.quantization.weights import (
    WEIGHT_DTYPES,
    QuantizedWeight,
    check_quantized_weight,
    dequantize_weight,
    quantize_weight,
)
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, kv_quant_dtype, kv_token_bytes

__all__ = ["QuantizedWeight", "WEIGHT_DTYPES", "STRATEGIES", "KV_CACHE_DTYPES", "quantize_weight",
           "dequantize_weight", "check_quantized_weight", "quantized_linear", "default_strategy",
           "write_kv_quantized", "kv_quant_dtype", "kv_token_bytes"]
