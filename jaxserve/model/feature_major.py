"""Linear layers that run their product feature-major: weights stored [out, in], activations turned [in, tokens].

XLA:CPU with YNNPACK runs `W @ X` (W [out, in], X [in, tokens]) much faster than the engine's `x @ W`
(W [in, out]) for the few-token steps of decoding: the 124.7M model's 85 float32 products took 22-23 ms
against 27-33 ms at 4 tokens and 32-33 against 44-50 at 16, the same at 1 (docs/performance.md, "The
weight layout, measured again"; `benchmarks/cpu_matmul_layout.py`). The rest of the model stays
token-major, so each product of a few rows is an island: transpose the activations in, multiply,
transpose out. Steps of many rows (prefill) multiply `x @ W.T` directly, which was faster there.

The two optimization barriers are what make the island work. Without them XLA's layout assignment
folds the transposes into the dot and its neighbours, and picks the dot's slow form back (the 124.7M
model's chain ran 4-6x slower at 4 tokens when a single transpose was left free at its end). With them
the transposes stay two small copies of the activations ([tokens, features] floats) per product.

Quantized layers keep their product but store their int8 codes [out, in] too: XLA:CPU's int8 GEMM ran
the 124.7M model's int8 x int8 products 1.7x faster at 2 rows, 2x at 4, 1.6x at 16, and faster at 128
and 512 too, so they need no islands (a one-row step is padded to two rows as before).

`feature_major_linears(model)` turns a loaded model into this form once, after loading
(`jaxserve/loader/placement.py`'s `feature_major`): every `nnx.Linear` of the decoder layers and the untied
LM head becomes a `FeatureMajorLinear` holding its transposed kernel, with q/k/v and gate/up fused into one
product each (`FusedProjections`). A mapped checkpoint can store the turned form itself (`jaxserve convert
--format mapped`, jaxserve/loader/turned.py), so that a start uses it where it lies instead of turning a copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.quantized_linear import QuantizedLinear


# From this many rows up, `x @ W.T` straight (no barriers) was as fast or faster (the step's products in
# one chain with [out, in] weights, YNNPACK: 62.7 against 63.2 ms at 64 tokens, 104.6 / 111.2 at 128,
# 387 / 519 at 512, 1678 / 2295 at 2048), and from 256 up also faster than Eigen's `x @ W`.
ISLAND_BELOW_ROWS = 64

# From this hidden size up the turned products paid (the 124.7M model, 768); stories260K (64) ran faster as it
# was, its step being attention's small products rather than the weights' (jaxserve/execution/cpu_matmuls.py).
TURNED_FROM_HIDDEN = 512


def turning_pays(config, dtype, devices: int) -> bool:
    """Whether a CPU runs this model's products feature-major by default: float32 linear layers, or int8 ones
    whose codes run turned, of hidden size `TURNED_FROM_HIDDEN` up, on one device (on a mesh the partition
    specs would have to turn with the kernels)."""
    spec = config.linear_quantization
    float32 = jnp.dtype(dtype) == jnp.float32 and spec is None
    turnable = (spec is not None and spec.codes == "int8" and spec.strategy == "dynamic_int8"
                and spec.block_size is None and spec.act_block is None)
    return config.hidden_size >= TURNED_FROM_HIDDEN and devices == 1 and (float32 or turnable)


def feature_major_product(weight: jax.Array, x: jax.Array) -> jax.Array:
    """x [..., in] @ weight.T for weight [out, in] -> [..., out]: as weight @ x.T between barriers for a
    few rows, as one dot contracting both operands' last axes for many (the row count is static)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= ISLAND_BELOW_ROWS:
        product = jax.lax.dot_general(rows, weight, (((1,), (1,)), ((), ())))
    else:
        columns = jax.lax.optimization_barrier(rows.T)
        product = jax.lax.optimization_barrier(weight @ columns).T
    return product.reshape(*x.shape[:-1], weight.shape[0])


class FeatureMajorLinear(nnx.Module):
    """An `nnx.Linear` with its kernel stored transposed (`weight` [out, in], as Hugging Face stores it)."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None):
        self.weight = nnx.Param(weight)
        self.bias = None if bias is None else nnx.Param(bias)

    def project(self, x: jax.Array) -> jax.Array:
        """x @ W, without the bias (`parallel.row_parallel` adds it after its all-reduce)."""
        return feature_major_product(self.weight[...], x.astype(self.weight.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.project(x)
        return y if self.bias is None else y + self.bias[...]


class FusedProjections(FeatureMajorLinear):
    """Several projections of one input as one product: their [out, in] weights stacked along out, so a
    step reads them in one pass (`names`, in order, with `sizes` outputs each); `llama.project_group`
    splits the result. The 124.7M model's chain of one-token products took 17.1 ms with q, k, v and gate,
    up fused, against 20.1 apart (`benchmarks/cpu_matmul_layout.py`; docs/performance.md, "Feature-major
    products"): fewer, larger products pay XLA's fixed cost per dot less often."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None, names: tuple[str, ...], sizes: tuple[int, ...]):
        super().__init__(weight, bias)
        self.names, self.sizes = names, sizes

    def split(self, x: jax.Array) -> list[jax.Array]:
        y = self(x)
        bounds = [sum(self.sizes[:i]) for i in range(1, len(self.sizes))]
        return jnp.split(y, bounds, axis=-1)


# The projections that read one input, per module: fused when every one of them is a plain nnx.Linear.
FUSIBLE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _take_kernel(linear: nnx.Linear) -> tuple[jax.Array, jax.Array | None]:
    kernel = linear.kernel[...]
    linear.kernel = None  # the transposed copy replaces it: drop this reference as soon as it is made
    return kernel, None if linear.bias is None else linear.bias[...]


def _turned(linear: nnx.Linear) -> FeatureMajorLinear:
    kernel, bias = _take_kernel(linear)
    # The last two axes: layers under lax.scan hold their kernels stacked [repeats, in, out].
    return FeatureMajorLinear(jnp.swapaxes(kernel, -1, -2), bias)


def _fuse_group(module: nnx.Module, names: tuple[str, ...]) -> None:
    """The layers `names` of `module` as one `fused_projections`, when all are plain nnx.Linear layers with
    biases alike (MoE experts hold arrays under these names, quantized layers keep theirs apart)."""
    linears = [getattr(module, name, None) for name in names]
    if not all(isinstance(linear, nnx.Linear) for linear in linears) or hasattr(module, "fused_projections"):
        return
    if len({linear.bias is None for linear in linears}) > 1:
        return
    parts = [_take_kernel(linear) for linear in linears]
    sizes = tuple(kernel.shape[-1] for kernel, _ in parts)
    weight = jnp.swapaxes(jnp.concatenate([kernel for kernel, _ in parts], axis=-1), -1, -2)
    bias = None if parts[0][1] is None else jnp.concatenate([b for _, b in parts], axis=-1)
    del parts
    for name in names:
        delattr(module, name)
    module.fused_projections = FusedProjections(weight, bias, names, sizes)


def turnable_codes(linear: QuantizedLinear) -> bool:
    """Quantized layers whose codes run turned: dynamic int8 with per-channel scales, per-row activation
    scales and no zero points (`quantized_linear(..., codes_out_in=True)`)."""
    return (linear.strategy == "dynamic_int8" and linear.scales.shape[-2] == 1 and linear.zeros is None
            and linear.act_block_size is None)


def _turn_codes(linear: QuantizedLinear) -> None:
    if turnable_codes(linear) and not linear.codes_out_in:
        linear.codes = nnx.Param(jnp.swapaxes(linear.codes[...], -1, -2))
        linear.codes_out_in = True


def _turn_linears(module: nnx.Module) -> None:
    if not isinstance(module, nnx.List):
        for names in FUSIBLE_GROUPS:
            _fuse_group(module, names)
    children = enumerate(module) if isinstance(module, nnx.List) else list(vars(module).items())
    for key, child in children:
        if isinstance(child, QuantizedLinear):
            _turn_codes(child)
        elif isinstance(child, nnx.Linear):
            turned = _turned(child)
            if isinstance(module, nnx.List):
                module[key] = turned
            else:
                setattr(module, key, turned)
        elif isinstance(child, nnx.Module) and not isinstance(child, FeatureMajorLinear):
            _turn_linears(child)


def feature_major_linears(model: nnx.Module) -> nnx.Module:
    """`model` (a decoder with concrete weights) with every `nnx.Linear` of its layers, and its untied LM
    head, replaced in place by a `FeatureMajorLinear` (q, k, v and gate, up fused into one
    `FusedProjections` each), and the codes of quantized layers that can run turned stored [out, in];
    each old kernel is freed as its copy is made when the caller holds no other reference to it."""
    _turn_linears(model.layers)
    head = getattr(model, "lm_head", None)
    if isinstance(head, QuantizedLinear):
        _turn_codes(head)
    elif isinstance(head, nnx.Linear):
        model.lm_head = _turned(head)
    return model
