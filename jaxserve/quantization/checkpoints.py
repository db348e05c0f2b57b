"""Pre-quantized Hugging Face checkpoints: detect the format from config.json, read each linear layer.

1. `detect_checkpoint_quantization(config)` reads `quantization_config`: compressed-tensors
   (`int-quantized` int8 and `float-quantized` fp8, what llm-compressor writes), AutoAWQ GEMM int4 and
   GPTQ int4 (v1 and v2 zero points, desc_act false). Any other method, format or scheme raises
   `UnsupportedQuantization` naming it, before a byte of weights is read, so nothing loads wrong.
2. A linear layer is quantized iff its quantized tensors are present (`is_quantized(prefix, names)`);
   the rest (embeddings, norms, usually the LM head) are ordinary float tensors.
3. `read_linear(prefix, get_tensor)` turns the stored tensors (PyTorch's [out, in] orientation, or the
   int4 formats' packed words) into a `QuantizedWeight` of host numpy arrays in our [in, out] layout:
   int8 / e4m3 codes with per-channel, per-group or per-block scales, or int4 codes with per-group
   scales and, for asymmetric checkpoints, zero points. The loader places them on devices.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from jaxserve.json_files import read_json_object
from jaxserve.quantization.packing import AWQ_ORDER, unpack_columns, unpack_rows
from jaxserve.quantization.weights import QuantizedWeight, check_quantized_weight

SUPPORTED = "compressed-tensors (int-quantized, float-quantized), awq (gemm, 4 bits), gptq (4 bits)"
GetTensor = Callable[[str], np.ndarray]


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization that jaxserve cannot load exactly; the message names what and why."""


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{what} is not supported (supported quantized checkpoints: {SUPPORTED})")


def _int4_weight(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, name: str) -> QuantizedWeight:
    """uint8 codes [in, out] in 0..15, scales and zero points [groups, out]: symmetric (every zero 8)
    becomes signed int4 codes without zero points, anything else uint4 codes with int8 zeros (GPTQ v1
    can store a zero of 16)."""
    scales = np.ascontiguousarray(scales, np.float32)
    if np.all(zeros == 8):
        signed = (codes.astype(np.int8) - 8).astype(ml_dtypes.int4)
        return check_quantized_weight(QuantizedWeight(signed, scales), name)
    weight = QuantizedWeight(codes.astype(ml_dtypes.uint4), scales, np.ascontiguousarray(zeros, np.int8))
    return check_quantized_weight(weight, name)


def _group_size(value, rows: int, name: str) -> int:
    group = rows if value in (None, -1) else int(value)
    if group < 1 or rows % group:
        raise UnsupportedQuantization(f"{name}: group size {value} does not divide its {rows} input rows")
    return group


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a checkpoint's `quantization_config` says, and how to read its quantized linear layers."""
    method: str  # "compressed-tensors" | "awq" | "gptq"
    weight_dtype: str  # "int8" | "fp8" | "int4"
    activation_dtype: str | None  # "int8" / "fp8": the checkpoint expects dynamic per-token activations
    summary: str  # one line for the startup log

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        raise NotImplementedError

    def is_quantized(self, prefix: str, names) -> bool:
        """Whether the linear layer at `prefix` (e.g. `model.layers.0.mlp.up_proj`) is stored quantized."""
        return self.tensor_names(prefix)[0] in names

    def read_linear(self, prefix: str, get_tensor: GetTensor) -> QuantizedWeight:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class CompressedTensors(CheckpointQuantization):
    strategy: str = "channel"  # "channel" | "tensor" | "group" | "block"
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None  # (out, in) rows and columns per scale block

    def tensor_names(self, prefix):
        return (f"{prefix}.weight_scale", f"{prefix}.weight")

    def read_linear(self, prefix, get_tensor):
        scale_name, weight_name = self.tensor_names(prefix)
        weight = get_tensor(weight_name)
        want = np.int8 if self.weight_dtype == "int8" else ml_dtypes.float8_e4m3fn
        if weight.dtype != want or weight.ndim != 2:
            raise ValueError(f"{weight_name}: expected a 2-D {np.dtype(want)} tensor, got {weight.dtype} "
                             f"{weight.shape}")
        out, rows = weight.shape
        scale = np.asarray(get_tensor(scale_name), np.float32)
        if self.strategy == "tensor":
            scales = np.broadcast_to(scale.reshape(1, 1), (1, out))
        elif self.strategy == "channel":
            scales = scale.reshape(1, out)
        elif self.strategy == "group":
            scales = scale.reshape(out, rows // _group_size(self.group_size, rows, weight_name)).T
        else:  # [out / bo, in / bi] blocks: repeat each block's scale over its bo output columns
            bo, bi = self.block_structure
            if rows % bi:
                raise UnsupportedQuantization(f"{weight_name}: block width {bi} does not divide {rows} input rows")
            scales = np.repeat(scale.reshape(-(-out // bo), rows // bi), bo, axis=0)[:out].T
        return check_quantized_weight(QuantizedWeight(np.ascontiguousarray(weight.T),
                                                      np.ascontiguousarray(scales, np.float32)), weight_name)


@dataclasses.dataclass(frozen=True)
class AutoAWQ(CheckpointQuantization):
    group_size: int = 128

    def tensor_names(self, prefix):
        return (f"{prefix}.qweight", f"{prefix}.qzeros", f"{prefix}.scales")

    def read_linear(self, prefix, get_tensor):
        qweight, qzeros, scales = (get_tensor(n) for n in self.tensor_names(prefix))
        codes = unpack_columns(qweight, AWQ_ORDER)  # [in, out]
        zeros = unpack_columns(qzeros, AWQ_ORDER)  # [groups, out]
        _group_size(self.group_size, codes.shape[0], f"{prefix}.qweight")
        return _int4_weight(codes, scales, zeros, f"{prefix}.qweight")


@dataclasses.dataclass(frozen=True)
class Gptq(CheckpointQuantization):
    group_size: int = 128
    zero_offset: int = 1  # v1 ("gptq") stores zero - 1; v2 stores the zero itself
    symmetric: bool = True  # every zero point 8: read as signed int4 codes without zeros

    def tensor_names(self, prefix):
        return (f"{prefix}.qweight", f"{prefix}.qzeros", f"{prefix}.scales", f"{prefix}.g_idx")

    def read_linear(self, prefix, get_tensor):
        name = f"{prefix}.qweight"
        codes = unpack_rows(get_tensor(name))  # [in, out]
        rows = codes.shape[0]
        group = _group_size(self.group_size, rows, name)
        try:
            g_idx = np.asarray(get_tensor(f"{prefix}.g_idx"))
        except KeyError:  # some writers leave out the trivial g_idx
            g_idx = None
        if g_idx is not None and not np.array_equal(g_idx, np.arange(rows) // group):
            raise _refuse(f"{prefix}.g_idx in act-order (not input row // group_size)")
        # Unpacked nibbles are 0..15, so v1's stored zero - 1 of a zero 0 reads back as 16, as in its kernels.
        zeros = unpack_columns(get_tensor(f"{prefix}.qzeros")).astype(np.int16) + self.zero_offset
        return _int4_weight(codes, get_tensor(f"{prefix}.scales"), zeros, name)


def _ct_scheme(qc: dict) -> tuple[dict, dict | None, str]:
    """The one weights scheme, input-activations scheme and format of a compressed-tensors config."""
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = {repr((g.get("weights"), g.get("input_activations"), g.get("format") or qc.get("format")))
               for g in groups.values()}
    if len(schemes) > 1:
        raise _refuse("compressed-tensors with several different schemes (mixed precision)")
    group = next(iter(groups.values()))
    fmt = group.get("format") or qc.get("format")
    return group.get("weights") or {}, group.get("input_activations"), fmt


def _compressed_tensors(qc: dict) -> CompressedTensors:
    weights, acts, fmt = _ct_scheme(qc)
    if fmt not in ("int-quantized", "float-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r}")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse(f"compressed-tensors quantization_status {status!r}")
    if qc.get("sparsity_config"):
        raise _refuse("compressed-tensors with a sparsity_config")
    kind = {"int-quantized": "int", "float-quantized": "float"}[fmt]
    if weights.get("num_bits") != 8 or weights.get("type", kind) != kind:
        raise _refuse(f"compressed-tensors {fmt} weights of {weights.get('num_bits')} bits, type {weights.get('type')}")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise _refuse(f"compressed-tensors {fmt} with asymmetric or dynamic weight scales")
    strategy = weights.get("strategy", "channel")
    if strategy not in ("channel", "tensor", "group", "block"):
        raise _refuse(f"compressed-tensors weight strategy {strategy!r}")
    block = weights.get("block_structure")
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise _refuse(f"compressed-tensors block strategy with block_structure {block!r}")
    act_dtype = None
    if acts:
        if acts.get("num_bits") != 8 or acts.get("type") not in ("int", "float") or not acts.get("symmetric", True):
            raise _refuse(f"compressed-tensors input activations {acts}")
        act_dtype = "int8" if acts.get("type") == "int" else "fp8"
    weight_dtype = "int8" if kind == "int" else "fp8"
    granularity = {"channel": "per channel", "tensor": "per tensor", "group": f"groups of {weights.get('group_size')}",
                   "block": f"blocks of {block}"}[strategy]
    act_text = "float activations"
    if acts:
        how = "dynamic" if acts.get("dynamic") else "static scales, run dynamically"
        act_text = f"{act_dtype} activations per token ({how})"
    return CompressedTensors(
        method="compressed-tensors", weight_dtype=weight_dtype, activation_dtype=act_dtype,
        summary=f"compressed-tensors {fmt}: {weight_dtype} weights {granularity}, {act_text}",
        strategy=strategy, group_size=weights.get("group_size"), block_structure=tuple(block) if block else None)


def _awq(qc: dict) -> AutoAWQ:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} (a different packing than GEMM)")
    bits = qc.get("bits", qc.get("w_bit", 4))  # AutoAWQ's own quant_config.json says w_bit
    if bits != 4:
        raise _refuse(f"AWQ with {bits} bits")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ without zero points")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return AutoAWQ(method="awq", weight_dtype="int4", activation_dtype=None,
                   summary=f"AutoAWQ GEMM int4 weights, groups of {group}, zero points", group_size=group)


def _gptq(qc: dict) -> Gptq:
    if qc.get("bits") != 4:
        raise _refuse(f"GPTQ with {qc.get('bits')} bits")
    if qc.get("desc_act"):
        raise _refuse("GPTQ with desc_act true (act-order: input rows permuted across groups)")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r}")
    if qc.get("pack_dtype", "int32") != "int32":
        raise _refuse(f"GPTQ pack_dtype {qc.get('pack_dtype')!r}")
    group = qc.get("group_size", 128)
    sym = "symmetric" if qc.get("sym", True) else "zero points"
    return Gptq(method="gptq", weight_dtype="int4", activation_dtype=None,
                summary=f"GPTQ ({fmt}) int4 weights, groups of {group}, {sym}", group_size=group,
                zero_offset=1 if fmt == "gptq" else 0, symmetric=bool(qc.get("sym", True)))


# Older exports keep the settings beside config.json instead of in it: AutoGPTQ's quantize_config.json
# (without quant_method before 0.7) and AutoAWQ's quant_config.json.
SIDECAR_CONFIGS = {"quantize_config.json": "gptq", "quant_config.json": "awq"}


def detect_checkpoint_quantization(config: dict, model_dir: str | Path | None = None
                                   ) -> CheckpointQuantization | None:
    """The quantization of a checkpoint from its config.json dict (and, without a `quantization_config`
    there, the side files of `model_dir`); None for a float checkpoint."""
    qc = config.get("quantization_config")
    if qc is None and model_dir is not None:
        for name, method in SIDECAR_CONFIGS.items():
            path = Path(model_dir) / name
            if path.is_file():
                qc = {"quant_method": method} | read_json_object(path)
                break
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    readers = {"compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise _refuse(f"quantization_config.quant_method {qc.get('quant_method')!r}")
    return readers[method](qc)
