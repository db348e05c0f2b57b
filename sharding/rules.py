"""Partition rules: a table from parameter path to logical axes, and one from logical axes to mesh axes.

1. `PARAM_RULES` names, per parameter path pattern, what each dimension of the parameter *is*
   (`vocab`, `heads`, `kv_heads`, `mlp`, or None for dimensions kept whole). Megatron's layout follows
   from it: q/k/v and gate/up are column-parallel (their output dimension is split), o_proj and down_proj
   are row-parallel (their input dimension is split, so each device holds a partial sum that the model
   all-reduces), the embedding and LM head are split over the vocabulary. Stacked MoE experts split each
   expert's intermediate size (`expert_mlp`) like the dense MLP, or, with expert parallelism, the
   experts axis (`EXPERT_PARALLEL_AXES`). Quantized linear layers' codes follow their float kernel; their
   scales and zero points [blocks, out] follow it on `out`, and a row-parallel layer's blocks of input rows
   split with the rows (one block, per channel, is replicated).
2. `LOGICAL_TO_MESH` maps those names to mesh axes: everything tensor-parallel uses the whole tensor
   group, except KV heads, which use only the `tensor` axis and so are replicated over `kv_replica`.
3. `param_layout` turns a parameter's path and shape into its padded shape and PartitionSpec on a stage's
   tensor group. `vocab` and `mlp` dimensions that do not divide are padded with zeros (zero embedding
   rows and LM-head columns are sliced off the logits; silu(0) * 0 = 0 in the MLP), so e.g. an
   intermediate size of 172 still splits eight ways. Heads must divide: that is checked at mesh creation.
4. A LoRA adapter's A [in, r] and B [r, out] of a projection follow its kernel [in, out] (`lora_layouts`):
   A takes the kernel's input dimension (split for o/down_proj), B its output dimension (split for
   q/k/v and gate/up), the rank stays whole; so the LoRA term is split exactly as the base layer's output.
5. Layer parameters get the pipeline axis in front of their first dimension at run time
   (`runtime_spec`): the stages' copies of layer slot j are stacked along dim 0.
"""

from __future__ import annotations

import dataclasses
import re

from jax.sharding import PartitionSpec as P

from sharding.mesh import PIPELINE, TENSOR, TP_AXES

# Parameter path ("layers/3/self_attn/q_proj/kernel") pattern -> logical axis of each dimension.
# Kernels are [in, out] (Flax layout); the embedding is [vocab, hidden].
PARAM_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^embed_tokens/(embedding|codes|scales)$", ("vocab", None)),  # --quantize-embedding: per-row scales
    (r"^lm_head/(kernel|codes|scales)$", (None, "vocab")),  # --quantize-lm-head: per-channel scales
    (r"/self_attn/q_proj/(kernel|codes|scales|zeros)$", (None, "heads")),
    (r"/self_attn/q_proj/bias$", ("heads",)),
    (r"/self_attn/[kv]_proj/(kernel|codes|scales|zeros)$", (None, "kv_heads")),
    (r"/self_attn/[kv]_proj/bias$", ("kv_heads",)),
    (r"/self_attn/o_proj/(kernel|codes)$", ("heads", None)),
    (r"/self_attn/o_proj/(scales|zeros)$", ("heads_blocks", None)),
    (r"/self_attn/o_proj/bias$", (None,)),  # added once, after the all-reduce
    (r"/mlp/(gate|up)_proj/(kernel|codes|scales|zeros)$", (None, "mlp")),
    (r"/mlp/(gate|up)_proj/bias$", ("mlp",)),
    (r"/mlp/down_proj/(kernel|codes)$", ("mlp", None)),
    (r"/mlp/down_proj/(scales|zeros)$", ("mlp_blocks", None)),
    (r"/mlp/down_proj/bias$", (None,)),
    (r"norm/weight$", (None,)),  # RMSNorm weights (input, post-attention, final, q/k norms)
    # Mixtures of experts: the router is replicated; each expert's MLP splits like the dense one.
    (r"/(mlp|block_sparse_moe)/gate/kernel$", (None, None)),
    (r"/experts/(gate_proj|up_proj|w1|w3)$", ("experts", None, "expert_mlp")),
    (r"/experts/(down_proj|w2)$", ("experts", "expert_mlp", None)),
    # Feature-major layers, weights [out, in] with q/k/v and gate/up fused (jaxserve/model/feature_major.py):
    # they run on one device only, so nothing in them is split.
    (r"/fused_projections/weight$", (None, None)),
    (r"/fused_projections/bias$", (None,)),
    (r"(^lm_head|/o_proj|/down_proj|/gate)/weight$", (None, None)),  # /gate: a mixture of experts' router
)

LOGICAL_TO_MESH: dict[str, str | tuple[str, ...]] = {
    "vocab": TP_AXES,
    "heads": TP_AXES,
    "mlp": TP_AXES,
    "expert_mlp": TP_AXES,
    "kv_heads": TENSOR,
    # Quantized row-parallel layers: their scales' blocks of input rows split with the rows (per-channel
    # scales, one block, are replicated: every shard's partial product is scaled by all of them).
    "heads_blocks": TP_AXES,
    "mlp_blocks": TP_AXES,
}

# `--enable-expert-parallel` (vLLM's flag): each device of the tensor group holds whole experts (E / tp of
# them, which must divide) instead of a 1 / tp slice of every expert's intermediate size.
EXPERT_PARALLEL_AXES: dict[str, str | tuple[str, ...] | None] = {"experts": TP_AXES, "expert_mlp": None}

PADDABLE = frozenset({"vocab", "mlp", "expert_mlp"})  # zero padding along these is exact
BLOCK_AXES = frozenset({"heads_blocks", "mlp_blocks"})  # scale blocks: one block stays whole

# KV pages (a layer's, or every layer's blocks along the pages axis): [num_kv_heads, num_pages, page_size, head_dim].
KV_CACHE_AXES = ("kv_heads", None, None, None)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    shape: tuple[int, ...]  # as stored in the checkpoint
    padded: tuple[int, ...]  # as placed on devices
    spec: P  # over the tensor axes, for the logical (per-layer) parameter


def path_str(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    name = path_str(path)
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, name):
            if len(axes) != ndim:
                raise ValueError(f"partition rule {pattern!r} has {len(axes)} axes for {ndim}-d parameter {name}")
            return axes
    raise ValueError(f"no partition rule matches parameter {name}; add one to sharding/rules.py")


def axis_size(mesh_axes: str | tuple[str, ...], mesh_shape: dict[str, int]) -> int:
    names = (mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes
    size = 1
    for n in names:
        size *= mesh_shape[n]
    return size


def param_layout(path: tuple, shape: tuple[int, ...], mesh_shape: dict[str, int], pad: bool = True,
                 expert_parallel: bool = False) -> ParamLayout:
    """Padded shape and tensor-axis PartitionSpec of one parameter.

    With pad=False (writing a checkpoint) a dimension that does not divide is kept whole instead.
    """
    axis_map = LOGICAL_TO_MESH | EXPERT_PARALLEL_AXES if expert_parallel else LOGICAL_TO_MESH
    padded, spec = [], []
    for dim, axis in zip(shape, logical_axes(path, len(shape))):
        mesh_axes = axis_map.get(axis) if axis else None
        n = axis_size(mesh_axes, mesh_shape) if mesh_axes else 1
        if axis in BLOCK_AXES and dim == 1:
            padded.append(dim)
            spec.append(None)
        elif dim % n == 0:
            padded.append(dim)
            spec.append(mesh_axes if n > 1 else None)
        elif axis in PADDABLE and pad:
            padded.append(-(-dim // n) * n)
            spec.append(mesh_axes)
        elif axis in PADDABLE:
            padded.append(dim)
            spec.append(None)
        else:
            raise ValueError(f"parameter {path_str(path)} dimension {dim} ({axis}) does not split {n} ways")
    return ParamLayout(tuple(shape), tuple(padded), P(*spec))


def is_layer_param(path: tuple) -> bool:
    return str(path[0]) == "layers"


def runtime_spec(path: tuple, spec: P, ndim: int) -> P:
    """Layer parameters carry the pipeline axis on dim 0 (stages stacked); the rest are replicated over it."""
    if not is_layer_param(path):
        return spec
    dims = list(spec) + [None] * (ndim - len(spec))
    first = dims[0]
    first = () if first is None else ((first,) if isinstance(first, str) else tuple(first))
    return P((PIPELINE,) + first, *dims[1:])


def kv_cache_spec() -> P:
    """KV pages [pp * num_kv_heads, pages, page_size, head_dim] (one layer's, or with scanned layers every
    layer's block along the pages axis, `KVCache`): stages stacked on dim 0, each
    stage's KV heads split over `tensor` (so replicated over `kv_replica`)."""
    assert KV_CACHE_AXES[0] == "kv_heads" and LOGICAL_TO_MESH["kv_heads"] == TENSOR
    return P((PIPELINE, TENSOR), None, None, None)


def kv_scales_spec() -> P:
    """Scales of quantized KV pages [pp * num_kv_heads, pages, page_size]: split like the pages."""
    return P(*kv_cache_spec()[:3])


def lora_layouts(block: str, module: str, shape: tuple[int, int], rank: int,
                 mesh_shape: dict[str, int]) -> tuple[ParamLayout, ParamLayout]:
    """Layouts of a LoRA A [in, rank] and B [rank, out] for the projection `block/module` whose kernel is
    `shape` = (in, out): each takes the kernel's padding and split along the dimension it shares with it."""
    kernel = param_layout(("layers", "0", block, module, "kernel"), shape, mesh_shape)
    spec = list(kernel.spec) + [None] * (2 - len(kernel.spec))
    return (ParamLayout((shape[0], rank), (kernel.padded[0], rank), P(spec[0], None)),
            ParamLayout((rank, shape[1]), (rank, kernel.padded[1]), P(None, spec[1])))
