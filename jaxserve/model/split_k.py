"""Decode-shaped products split along their contraction, each followed by one epilogue kernel (GPU, issue 52).

XLA:GPU splits a decode step's products along K itself (a few rows x 4096 columns are too few output tiles
for 132 multiprocessors) and sums the float32 partials in the kernels after them: after q/k/v, the K write,
the V write and q's rope (3 kernels); after o_proj and down_proj, the residual add, then the RMSNorm (2
each). Here, in GPU step programs of few rows only (`DecodeEpilogues`, set on the model at start:
jaxserve/engine/decode_epilogues.py):
1. The product as a batched one over S shares of K, `[S, T, K/S] x [S, K/S, N] -> [S, T, N]` float32
   (`splits`: enough column tiles x shares to fill the multiprocessors), which XLA compiles as one GEMM
   kernel that does not split again; an int8 weight-only layer with per-channel scales multiplies its
   codes, and its scales go to the epilogue. q, k and v are one product over their weights concatenated.
2. One Pallas kernel after it: `split_attention_heads` sums, ropes and writes q, K and V
   (pallas_kernels/qkv_epilogue.py, the pages in place); `residual_norm` sums, adds the residual and applies
   the next RMSNorm (pallas_kernels/residual_norm.py), returning the new residual and the normed
   activations (without a norm to apply, the stage's last layer, its `jnp` reference: one XLA kernel).
So a Llama layer is 10 kernels (9 where attention does not split the keys): q/k/v + epilogue, attention +
merge, o_proj + epilogue, gate/up, SiLU x up, down_proj + epilogue (jaxserve/model/llama.py's
`DecoderLayer.fused_call`). Prefill-sized steps, CPUs and TPUs keep the plain layer: their programs are
unchanged (the attribute stays None there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.quantized_linear import QuantizedLinear
from pallas_kernels.qkv_epilogue import fits as qkv_epilogue_fits, qkv_epilogue_gpu
from pallas_kernels._paged_common import next_pow2
from pallas_kernels.residual_norm import fits, residual_rms_norm_gpu, residual_rms_norm_reference

MAX_ROWS = 64  # decode buckets: more rows fill the GPU without a split, and the partials would grow
MULTIPROCESSORS = 132  # an H100's or H200's
COLUMN_TILE = 128  # output columns a GEMM program owns, about
MIN_SHARE = 256  # K rows a share keeps at least: a GEMM's K loop of a few steps


@dataclasses.dataclass(frozen=True)
class DecodeEpilogues:
    """Static attribute of a model: its decode steps split their row-parallel products and fuse the
    epilogues. `interpret`: the kernel in Pallas interpret mode (tests on a CPU)."""
    max_rows: int = MAX_ROWS
    interpret: bool = False

    def applies(self, rows: int) -> bool:
        return rows <= self.max_rows


def splits(k: int, n: int) -> int:
    """Shares of K for a [rows, k] x [k, n] decode product: a power of 2 that brings the column tiles up to the
    multiprocessors, while each share keeps `MIN_SHARE` rows of K and divides it (1: not split)."""
    s = next_pow2(-(-MULTIPROCESSORS // max(1, -(-n // COLUMN_TILE))))
    while s > 1 and (k % s or k // s < MIN_SHARE):
        s //= 2
    return s


def takes(linear: nnx.Module) -> bool:
    """Whether `split_partials` runs this layer's product: a float `nnx.Linear`, or an int8 / fp8 weight-only
    `QuantizedLinear` with per-channel scales and no zero points whose product XLA runs (no Pallas kernel
    plan, codes stored [in, out]); no bias (reads shapes only: the parameters may be abstract)."""
    if isinstance(linear, nnx.Linear):
        return linear.bias is None
    return (isinstance(linear, QuantizedLinear) and linear.strategy == "weight_only" and linear.bias is None
            and linear.kernel is None and not linear.codes_out_in and linear.zeros is None
            and linear.scales.shape[0] == 1 and jnp.dtype(linear.codes.dtype).itemsize == 1)


def _operand(linear: nnx.Module, dtype) -> tuple[jax.Array, jax.Array | None]:
    """(weight [K, N] in `dtype`, per-column scales [N] or None) of a layer `takes` accepts."""
    if isinstance(linear, nnx.Linear):
        return linear.kernel[...].astype(dtype), None
    return linear.codes[...].astype(dtype), linear.scales[...][0]


def _split(x: jax.Array, w: jax.Array) -> jax.Array:
    (t, k), n = x.shape, w.shape[1]
    s = splits(k, n)
    return jnp.einsum("tsk,skn->stn", x.reshape(t, s, k // s), w.reshape(s, k // s, n),
                      preferred_element_type=jnp.float32)


def split_partials(linear: nnx.Module, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x [T, K] @ W as float32 partial products [S, T, N] (summed over S: the product) and the layer's
    per-column scales (None for a float layer). `linear` must be one `takes` accepts."""
    w, scale = _operand(linear, x.dtype)
    return _split(x, w), scale


QKV = ("q_proj", "k_proj", "v_proj")


def takes_qkv(attention: nnx.Module) -> bool:
    """Whether `split_attention_heads` runs this attention module (a Llama-family one without q/k norms, the
    KV write kernel taking its head shape)."""
    c = attention.config
    return (not c.qk_norm and all(takes(getattr(attention, name)) for name in QKV)
            and qkv_epilogue_fits(c.num_heads, c.num_kv_heads, c.head_dim))


def split_attention_heads(plan: DecodeEpilogues, attention: nnx.Module, x, cos, sin, k_pages, v_pages, write_index,
                          attend) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`Attention.heads` of float pages with the q/k/v product split, its weights concatenated (XLA fuses the
    concatenation into the GEMM's operand: no copy), and one epilogue kernel (pallas_kernels/qkv_epilogue.py)
    that sums, ropes and writes q, K and V."""
    c = attention.config
    weights, scales = zip(*(_operand(getattr(attention, name), x.dtype) for name in QKV))
    partials = _split(x, jnp.concatenate(weights, axis=1))
    q, k_pages, v_pages = qkv_epilogue_gpu(partials, cos, sin, write_index, k_pages, v_pages, num_heads=c.num_heads,
                                           dtype=x.dtype, column_scales=None if scales[0] is None else scales,
                                           interpret=plan.interpret)
    return attend(q, k_pages, v_pages).reshape(x.shape[0], -1), k_pages, v_pages


def residual_norm(plan: DecodeEpilogues, partials: jax.Array, scale: jax.Array | None, residual: jax.Array,
                  norm: nnx.Module | None) -> tuple[jax.Array, jax.Array | None]:
    """(residual + the product, `norm` of it or None): one Pallas kernel with a norm whose shape it takes,
    else the `jnp` reference (`norm`: an RMSNorm module with `weight` and `eps`)."""
    if norm is None or not fits(partials.shape[2], partials.shape[0]):
        return residual_rms_norm_reference(partials, residual, None if norm is None else norm.weight[...],
                                           eps=0.0 if norm is None else norm.eps, column_scale=scale)
    return residual_rms_norm_gpu(partials, residual, norm.weight[...], eps=norm.eps, column_scale=scale,
                                 interpret=plan.interpret)
