"""Quantized linear layers in the model: the module, and the swap that puts them in place of `nnx.Linear`.

1. `QuantizedLinear` holds a layer's `codes` [in, out] (int8, e4m3, int4 or uint4), `scales` [blocks, out]
   float32, `zeros` [blocks, out] int8 (uint4 codes only) and the float bias as parameters, and runs
   `quantized_linear(x, weight, strategy)`: the strategy (weight-only, dynamic int8, dynamic fp8) is
   chosen once at start for the backend and is part of the config, so of the program cache key.
2. `quantize_linears(model, spec)` replaces every `nnx.Linear` inside the decoder layers by a
   `QuantizedLinear` of the same shape, after the model is built: the model families never see it, and
   the norms stay float (the LM head and the token embedding too, unless `--quantize-lm-head` /
   `--quantize-embedding`, the latter a `QuantizedEmbed` of codes and one scale per token row). The loader fills
   the parameters (`jaxserve/loader/quantized.py`): quantized from a float checkpoint, or read from a
   pre-quantized one.
3. `project` is the product without the bias: under tensor parallelism a row-parallel layer's shards each
   quantize their own slice of x (its own row scale), rescale their partial product, and the all-reduce
   adds them (`parallel.row_parallel`); no collective is needed for the activation scales.
4. A weight-only layer may carry a `KernelPlan` (`kernel`, set at start by jaxserve/engine/kernel_choice.py):
   the row counts at which a Pallas kernel runs its product instead of XLA (jaxserve/model/linear_kernels.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import LinearQuantization
from jaxserve.model.linear_kernels import KernelPlan, kernel_product
from jaxserve.quantization import QuantizedWeight, quantized_linear

CODE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4, "uint4": jnp.uint4}


class QuantizedLinear(nnx.Module):
    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, spec: LinearQuantization, dtype):
        block = spec.block_size or in_features
        if in_features % block:
            raise ValueError(f"quantization block size {block} does not divide {in_features} input features")
        blocks = in_features // block
        self.in_features, self.out_features = in_features, out_features
        self.codes = nnx.Param(jnp.zeros((in_features, out_features), CODE_DTYPES[spec.codes]))
        self.scales = nnx.Param(jnp.zeros((blocks, out_features), jnp.float32))
        self.zeros = nnx.Param(jnp.zeros((blocks, out_features), jnp.int8)) if spec.has_zeros else None
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.strategy = spec.strategy
        self.min_rows = spec.min_rows
        self.act_block_size = activation_block(in_features, spec.act_block) if spec.strategy != "weight_only" else None
        self.codes_out_in = False  # codes [out, in] once jaxserve/model/feature_major.py turns them
        self.kernel: KernelPlan | None = None  # weight-only: where a Pallas kernel runs the product (static)

    def weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes[...], self.scales[...], None if self.zeros is None else self.zeros[...])

    def project(self, x: jax.Array) -> jax.Array:
        """x @ W, without the bias."""
        rows = math.prod(x.shape[:-1])
        if self.kernel is not None and self.strategy == "weight_only" and self.kernel.runs_kernel(rows):
            return kernel_product(x, self.weight(), self.kernel.flavour, self.kernel.interpret)
        return quantized_linear(x, self.weight(), self.strategy, min_rows=self.min_rows,
                                act_block_size=self.act_block_size, codes_out_in=self.codes_out_in)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.project(x)
        return y if self.bias is None else y + self.bias[...]


def activation_block(features: int, target: int | None) -> int | None:
    """The block of input features an activation scale covers: `target` where it divides them, else the
    largest divisor between target / 2 and 2 x target (stories260K's 172 features: 43), else one per row."""
    if target is None or features <= target:
        return None
    fitting = [d for d in range(target // 2, min(2 * target, features - 1) + 1) if features % d == 0]
    if target in fitting:
        return target
    return max(fitting) if fitting else None


class QuantizedEmbed(nnx.Module):
    """The token embedding as `codes` [vocab, hidden] with one float32 scale per token row (`scales`
    [vocab, 1]): a lookup gathers its rows' codes and scales, so the table is never dequantized whole."""

    def __init__(self, num_embeddings: int, features: int, *, spec: LinearQuantization, dtype):
        self.num_embeddings, self.features, self.dtype = num_embeddings, features, dtype
        self.codes = nnx.Param(jnp.zeros((num_embeddings, features), CODE_DTYPES[spec.codes]))
        self.scales = nnx.Param(jnp.zeros((num_embeddings, 1), jnp.float32))

    def lookup(self, rows: jax.Array) -> jax.Array:
        """The embedding of table rows `rows` (tokens, or a device's local rows under tensor parallelism)."""
        codes = jnp.take(self.codes[...], rows, axis=0).astype(jnp.float32)
        return (codes * jnp.take(self.scales[...], rows, axis=0)).astype(self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.lookup(tokens)


def quantize_linears(model: nnx.Module, spec: LinearQuantization) -> nnx.Module:
    """Every `nnx.Linear` of `model.layers` replaced by an (empty) `QuantizedLinear` of its shape (but those a
    module names in `float_linears`), the LM head when `spec.lm_head` and the token embedding by a
    `QuantizedEmbed` when `spec.embedding`."""
    def quantized(linear: nnx.Linear) -> QuantizedLinear:
        return QuantizedLinear(linear.in_features, linear.out_features, use_bias=linear.bias is not None,
                               spec=spec, dtype=linear.param_dtype)

    def swap(module: nnx.Module) -> None:
        for name, child in list(vars(module).items()):
            if name in getattr(module, "float_linears", ()):  # e.g. a mixture's router: kept in float
                continue
            if isinstance(child, nnx.Linear):
                setattr(module, name, quantized(child))
            elif isinstance(child, nnx.Module):
                swap(child)

    for layer in model.layers:
        swap(layer)
    if spec.lm_head:
        model.lm_head = quantized(model.lm_head)
    if spec.embedding:
        table = model.embed_tokens
        model.embed_tokens = QuantizedEmbed(table.num_embeddings, table.features, spec=spec, dtype=table.dtype)
    return model
