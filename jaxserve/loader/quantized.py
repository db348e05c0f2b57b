"""Quantized linear layers at load: decide what the weights become, then fill codes, scales and zeros.

1. A checkpoint's description (`formats.Checkpoint`) says what its config.json declares (a pre-quantized
   checkpoint, detected from its `quantization_config` or refused by name before a byte is read) or how a
   converted checkpoint stores its layers (`stored_layers`). `quantized_config` reconciles that with the
   flags (`QuantizationFlags`: int8 / fp8 quantize a float checkpoint at load; a flag that disagrees with
   the checkpoint is an error naming both) and picks the strategy for the backend once (`default_strategy`).
2. The model config then carries the result (`ModelConfig.linear_quantization`), so the abstract model
   the loader plans from has `QuantizedLinear` layers, whose `codes`, `scales` and `zeros` entries
   `QuantizedLinearReader` fills: each linear layer's `QuantizedWeight` is made once on the host, by
   quantizing the float kernel per output channel or by the checkpoint format's `read_linear`, and
   handed out region by region like any tensor (each device reads its own slice); the LM head and the
   token embedding likewise when asked (the embedding per token row, `QuantizedEmbed`). Every other
   parameter (norms, biases, float embeddings and head) goes to the wrapped reader as before.
3. A converted checkpoint (`jaxserve convert --quantization`) stores the layers as they run: codes, scales
   and zeros by parameter path, described in its marker (`describe_stored`). It is read like any other
   parameter, in place where the format allows; only the strategy is chosen again, for this backend.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

import jax
import ml_dtypes
import numpy as np

from jaxserve.config import LinearQuantization, ModelConfig
from jaxserve.loader.placement import RegionReader
from jaxserve.loader.safetensors import SafetensorsReader, hf_tensor_name
from jaxserve.loader.tree import ParamPath
from jaxserve.model.quantized_linear import CODE_DTYPES
from jaxserve.quantization import QuantizedWeight, default_strategy, dequantize_weight, quantize_weight
from jaxserve.quantization.checkpoints import CheckpointQuantization, Gptq

if TYPE_CHECKING:
    from jaxserve.engine_args import EngineArgs

QUANTIZED_PARTS = ("codes", "scales", "zeros")
EMBEDDING = ("embed_tokens",)  # quantized per row (`--quantize-embedding`); linear layers per output column


@dataclasses.dataclass(frozen=True)
class QuantizationFlags:
    """What the quantization flags ask. `method`: `--quantization` (None: follow the checkpoint; "none":
    float layers); `strategy`: `--quantization-strategy` (None: the backend's choice); `lm_head` /
    `embedding`: `--quantize-lm-head` / `--quantize-embedding`, quantized at load too."""
    method: str | None = None
    strategy: str | None = None
    lm_head: bool = False
    embedding: bool = False

    @classmethod
    def of(cls, args: EngineArgs) -> QuantizationFlags:
        return cls(args.quantization, args.quantization_strategy, args.quantize_lm_head, args.quantize_embedding)


def _checkpoint_codes(ckpt: CheckpointQuantization) -> str:
    if ckpt.weight_dtype != "int4":
        return ckpt.weight_dtype
    # GPTQ sym stores every zero point as 8: signed codes, no zeros. AWQ always carries zero points.
    return "int4" if isinstance(ckpt, Gptq) and ckpt.symmetric else "uint4"


def _checkpoint_block(ckpt: CheckpointQuantization) -> int | None:
    group = getattr(ckpt, "group_size", None)
    if getattr(ckpt, "strategy", "group") in ("channel", "tensor"):
        return None
    if getattr(ckpt, "strategy", None) == "block":
        return int(ckpt.block_structure[1])
    return None if group in (None, -1) else int(group)


# What a converted checkpoint's marker records of its linear layers: how they are stored, not how they run.
STORED_FIELDS = ("codes", "block_size", "lm_head", "embedding", "source")


def stored_layers(marker: dict) -> dict | None:
    """How a converted checkpoint stores its linear layers ({codes, block_size, lm_head, embedding, source,
    float_activations}: its marker's entry, `describe_stored`); None for float layers."""
    stored = marker.get("linear_quantization")
    # A marker written before --quantize-embedding has no key for it: its embedding is float.
    return None if stored is None else {"embedding": False, **stored}


QUANTIZED_AT_LOAD = "quantized at load"
QUANTIZED_BY_CONVERT = "quantized by `jaxserve convert`"


def describe_stored(spec: LinearQuantization, float_activations: bool) -> dict:
    """The marker entry for linear layers stored as `spec` (`stored_layers` reads it back)."""
    entry = {name: getattr(spec, name) for name in STORED_FIELDS}
    return {**entry, "source": _stored_source(entry["source"]), "float_activations": float_activations}


def _stored_source(source: str) -> str:
    """Where stored codes came from, as the startup log says it: layers `convert` quantized are read as they lie
    at every start, not quantized at load (markers written before this said that)."""
    return QUANTIZED_BY_CONVERT if source == QUANTIZED_AT_LOAD else source


def requantizes(requested: str | None, ckpt: CheckpointQuantization | None) -> bool:
    """`--quantization int8` on an fp8 checkpoint: its layers dequantized and quantized again to int8 per
    output channel, because a CPU has no fp8 arithmetic and runs fp8 codes weight-only (0.15-0.5x float32)
    while int8 runs its integer products (llama.cpp's quantize tool has --allow-requantize for the same)."""
    return requested == "int8" and ckpt is not None and ckpt.weight_dtype == "fp8"


def made_for_float_activations(ckpt: CheckpointQuantization | None) -> bool:
    """A checkpoint quantized for float activations (compressed-tensors W8A16): served weight-only."""
    return ckpt is not None and ckpt.method == "compressed-tensors" and ckpt.activation_dtype is None


def choose_strategy(codes: str, platform: str, weights_only_checkpoint: bool = False) -> tuple[str, int]:
    """(strategy, min_rows) for linear layers of `codes` on `platform` (docs/quantization.md): a checkpoint
    made for float activations (W8A16) keeps them; one-row integer batches on CPU are padded to two."""
    if weights_only_checkpoint or codes in ("int4", "uint4"):
        return "weight_only", 1
    strategy = default_strategy(platform, CODE_DTYPES[codes])
    return strategy, 2 if platform == "cpu" and strategy == "dynamic_int8" else 1


def linear_quantization(requested: str | None, ckpt: CheckpointQuantization | None,
                        platform: str | None = None, strategy: str | None = None,
                        stored: dict | None = None) -> LinearQuantization | None:
    """What the linear layers become. `requested`: `--quantization` (None: follow the checkpoint);
    `strategy`: `--quantization-strategy` (None: the backend's choice); `stored`: a converted checkpoint's
    quantized layers (`stored_layers`)."""
    platform = (platform or jax.default_backend()).lower()
    spec = _linear_quantization(requested, ckpt, platform, stored)
    if spec is None or strategy is None:
        return spec
    if strategy == "dynamic_int8" and spec.codes == "fp8" or strategy == "dynamic_fp8" and spec.codes != "fp8":
        raise ValueError(f"--quantization-strategy {strategy} cannot run {spec.codes} weights")
    min_rows = 2 if platform == "cpu" and strategy == "dynamic_int8" else 1
    return dataclasses.replace(spec, strategy=strategy, min_rows=min_rows)


def _linear_quantization(requested, ckpt, platform, stored=None) -> LinearQuantization | None:
    if stored is not None:
        codes = stored["codes"]
        if requested is not None and requested != codes:
            raise ValueError(f"--quantization {requested} disagrees with the converted checkpoint, which stores "
                             f"{codes} linear layers ({stored['source']}): leave --quantization out to serve "
                             f"it as stored, or convert the Hugging Face checkpoint again")
        strategy, min_rows = choose_strategy(codes, platform, stored["float_activations"])
        return LinearQuantization(codes, stored["block_size"], strategy, min_rows,
                                  source=_stored_source(stored["source"]),
                                  lm_head=stored["lm_head"], embedding=stored["embedding"])
    if ckpt is not None and requantizes(requested, ckpt):
        strategy, min_rows = choose_strategy("int8", platform)
        return LinearQuantization("int8", None, strategy, min_rows,
                                  source=f"{ckpt.summary}, re-quantized to int8 at load")
    if ckpt is not None:
        if requested is not None and requested != ckpt.weight_dtype:
            raise ValueError(f"--quantization {requested} disagrees with the checkpoint, which is quantized "
                             f"as {ckpt.summary} ({ckpt.weight_dtype} weights): leave --quantization out to "
                             f"use it as stored" + (" (only fp8 checkpoints can be re-quantized, to int8)"
                                                    if requested == "int8" else ""))
        codes = _checkpoint_codes(ckpt)
        strategy, min_rows = choose_strategy(codes, platform, made_for_float_activations(ckpt))
        return LinearQuantization(codes, _checkpoint_block(ckpt), strategy, min_rows, source=ckpt.summary)
    if requested in (None, "none"):
        return None
    strategy, min_rows = choose_strategy(requested, platform)
    return LinearQuantization(requested, None, strategy, min_rows, source=QUANTIZED_AT_LOAD)


def quantized_config(config: ModelConfig, flags: QuantizationFlags, declared: CheckpointQuantization | None = None,
                     stored: dict | None = None, platform: str | None = None) -> ModelConfig:
    """The model's config with its linear layers as `flags` ask of a checkpoint whose config.json declares
    `declared`, or that `convert` stored as `stored` (`Checkpoint.served_config`): unchanged for float
    layers, else `linear_quantization` says what they become. `platform`: where the model will run, which
    decides how quantized layers run (default: this process's backend)."""
    spec = linear_quantization(flags.method, declared, platform, strategy=flags.strategy, stored=stored)
    if flags.lm_head and not (stored and stored["lm_head"]):
        spec = _with_part("--quantize-lm-head", "lm_head", "LM head", spec, declared, config, stored)
    if flags.embedding and not (stored and stored["embedding"]):
        spec = _with_part("--quantize-embedding", "embedding", "token embedding", spec, declared, config, stored)
    return config if spec is None else dataclasses.replace(config, linear_quantization=spec)


def describe_linear_layers(spec: LinearQuantization) -> str:
    """The startup log's line on quantized layers: what, how stored, from where, and how a step runs them."""
    blocks = f"in blocks of {spec.block_size} input rows" if spec.block_size else "per output channel"
    padded = f", batches padded to {spec.min_rows} rows" if spec.min_rows > 1 else ""
    return (f"{spec.quantized_parts}: {spec.codes} codes {blocks} ({spec.source}), run "
            f"{spec.strategy.replace('_', ' ')}{padded}")


def _with_part(flag: str, field: str, part: str, spec: LinearQuantization | None,
               ckpt: CheckpointQuantization | None, config: ModelConfig, stored: dict | None) -> LinearQuantization:
    """`spec` with the LM head or the token embedding (`field`) quantized at load too, or a ValueError
    saying why that cannot be."""
    if stored is not None:
        raise ValueError(f"{flag}: this converted checkpoint stores a float {part}; convert the Hugging Face "
                         f"checkpoint again with {flag}")
    if ckpt is not None:
        raise ValueError(f"{flag} quantizes a float checkpoint at load; this one is quantized as "
                         f"{ckpt.summary} and its {part} is served as stored")
    if spec is None:
        raise ValueError(f"{flag} needs --quantization (int8 or fp8)")
    if field == "lm_head" and (config.tie_word_embeddings or not config.has_lm_head):
        raise ValueError("--quantize-lm-head: this model has no LM head of its own (it reuses the embedding "
                         "matrix, or has no head at all)")
    if field == "embedding" and config.tie_word_embeddings:
        raise ValueError("--quantize-embedding: this model's embedding is its LM head too (tied), and a "
                         "quantized table is only looked up, not multiplied: serve the embedding in float")
    return dataclasses.replace(spec, **{field: True})


def _conform(qw: QuantizedWeight, spec: LinearQuantization, name: str) -> QuantizedWeight:
    """A layer read from a checkpoint in the representation every layer of the model shares."""
    codes = qw.codes
    if spec.codes == "uint4" and qw.zeros is None and codes.dtype == ml_dtypes.int4:
        # A symmetric layer in an asymmetric checkpoint (every zero point 8): back to codes + 8, zeros 8.
        qw = QuantizedWeight((codes.astype(np.int8) + 8).astype(ml_dtypes.uint4), qw.scales,
                             np.full(qw.scales.shape, 8, np.int8))
    if np.dtype(qw.codes.dtype) != np.dtype(CODE_DTYPES[spec.codes]):
        raise ValueError(f"{name}: {np.dtype(qw.codes.dtype)} codes where every layer of this checkpoint is "
                         f"{spec.codes} (a mixed-precision checkpoint is not supported)")
    return qw


def _host_device():
    """Where a float kernel is quantized before its codes are placed: the CPU, unless JAX runs without it."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return jax.devices()[0]


class QuantizedLinearReader(RegionReader):
    """`base`'s parameters, with each quantized linear layer's codes, scales and zeros made on the host:
    quantized from the float kernel `base` holds, or read by the checkpoint's format (`ckpt`)."""

    def __init__(self, base, spec: LinearQuantization, ckpt: CheckpointQuantization | None = None):
        if not isinstance(base, RegionReader):
            raise ValueError(f"quantized linear layers cannot be read from {base.description}: convert from "
                             f"the Hugging Face checkpoint, or serve it without quantization")
        if ckpt is not None and not isinstance(base, SafetensorsReader):
            raise ValueError(f"a {ckpt.method} checkpoint is read from Hugging Face safetensors only")
        self.base, self.spec, self.ckpt = base, spec, ckpt
        self._lock = threading.Lock()
        self._layers: dict[ParamPath, list] = {}  # prefix -> [lock, weight, parts still to hand out]
        self._codes_shapes: dict[ParamPath, tuple[int, int]] = {}

    @property
    def description(self) -> str:
        return f"{self.base.description}, linear layers {self.spec.source}"

    def _make(self, prefix: ParamPath, shape: tuple[int, int]) -> QuantizedWeight:
        if self.ckpt is not None:
            name = hf_tensor_name(prefix + ("kernel",))[0].removesuffix(".weight")
            qw = self.ckpt.read_linear(name, self.base.tensor)
            if self.spec.codes != _checkpoint_codes(self.ckpt):  # re-quantized (`requantizes`)
                with jax.default_device(_host_device()):
                    qw = jax.tree.map(np.asarray, quantize_weight(dequantize_weight(qw), self.spec.codes))
            qw = _conform(qw, self.spec, name)
        elif prefix == EMBEDDING:  # [vocab, hidden], one scale per token row: its transpose's per-column scales
            table = np.empty(shape, np.float32)
            self.base.reader(prefix + ("embedding",), shape)(tuple(slice(0, n) for n in shape), table)
            with jax.default_device(_host_device()):
                qw = quantize_weight(table.T, self.spec.codes)
                qw = QuantizedWeight(np.ascontiguousarray(np.asarray(qw.codes).T),
                                     np.ascontiguousarray(np.asarray(qw.scales).T), None)
        else:
            kernel = np.empty(shape, np.float32)
            self.base.reader(prefix + ("kernel",), shape)(tuple(slice(0, n) for n in shape), kernel)
            with jax.default_device(_host_device()):
                qw = jax.tree.map(np.asarray, quantize_weight(kernel, self.spec.codes, self.spec.block_size))
        if tuple(qw.codes.shape) != tuple(shape):
            raise ValueError(f"{'/'.join(prefix)}: stored weight is {qw.codes.shape}, the config implies {shape}")
        return qw

    def _weight(self, prefix: ParamPath, codes_shape: tuple[int, int]) -> QuantizedWeight:
        with self._lock:
            entry = self._layers.setdefault(prefix, [threading.Lock(), None, 3 if self.spec.has_zeros else 2])
        with entry[0]:
            if entry[1] is None:
                entry[1] = self._make(prefix, codes_shape)
            weight = entry[1]
            entry[2] -= 1
            if entry[2] == 0:  # every part handed out: the fills hold their own arrays
                with self._lock:
                    self._layers.pop(prefix, None)
        return weight

    def expect(self, shapes):
        # The [in, out] shape of every quantized layer, whichever of its parts a loader thread asks first.
        self._codes_shapes = {tuple(path[:-1]): shape for path, shape in shapes.items() if path[-1] == "codes"}

    def reader(self, path: ParamPath, shape: tuple[int, ...]):
        if path[-1] not in QUANTIZED_PARTS:
            return self.base.reader(path, shape)
        prefix = tuple(path[:-1])
        value = getattr(self._weight(prefix, self._codes_shapes[prefix]), path[-1])
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{'/'.join(prefix)}/{path[-1]} has shape {value.shape}, the model expects {shape}")
        return lambda index, out: np.copyto(out, value[index], casting="unsafe")

    def in_place(self, path: ParamPath, dtype):
        return None if path[-1] in QUANTIZED_PARTS else self.base.in_place(path, dtype)

    def close(self) -> None:
        self.base.close()
