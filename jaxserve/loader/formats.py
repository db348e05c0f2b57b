"""Checkpoint formats, and the one description of a checkpoint that a build reads and hands down.

- A Hugging Face directory: `config.json` beside `model.safetensors` or a sharded index (`safetensors.py`).
- `jaxserve convert --format mapped`: safetensors in the model's own layout and dtype, every tensor
  64-byte aligned, used where it lies in the page cache (`mapped.py` writes it, `safetensors.py` reads it).
- `jaxserve convert --format orbax`: the parameters saved by Orbax, restored into any mesh (`orbax.py`).
A converted directory is marked by `jaxserve_checkpoint.json`, which names its format.

1. `Checkpoint.read(model_dir)` reads a directory's weights description once: its format and conversion
   marker, how its linear layers are stored (quantized by `convert`, feature-major) or what quantization
   its config.json declares, a converted checkpoint's dtype, and, when first asked, its shard files.
   `Checkpoint.in_memory` describes the weights a module holds (the random demo model, benchmarks).
2. The build hands the description down, and nothing after it reads the marker or the shard index again:
   the quantization decision (`served_config`), the CPU's product library (`in_place`, `lies_turned`),
   the dtype warnings, the reader.
3. `reader(model)` composes the readers for the abstract model being filled, by one rule: as stored ->
   the model's own layout (turned back from feature-major) -> quantized, where the layers are made at
   load -> turned, where the model runs feature-major and the checkpoint does not lie so already.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
from pathlib import Path

from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.json_files import read_json_object
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.orbax import OrbaxReader
from jaxserve.loader.placement import ModuleReader, RegionReader
from jaxserve.loader.quantized import (QuantizationFlags, QuantizedLinearReader, describe_linear_layers,
                                       quantized_config, stored_layers)
from jaxserve.loader.safetensors import SafetensorsReader, safetensors_files
from jaxserve.loader.turned import FEATURE_MAJOR_LAYOUT, TurningReader, UnturningReader
from jaxserve.quantization.checkpoints import CheckpointQuantization, detect_checkpoint_quantization

logger = logging.getLogger(__name__)

MARKER = "jaxserve_checkpoint.json"
HUGGING_FACE, MAPPED, ORBAX, IN_MEMORY = "huggingface", "mapped", "orbax", "in memory"
# Files a model directory needs besides its weights: a converted checkpoint carries copies.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt")


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """What a model's weights are and how they lie, read once (see the module docstring)."""
    format: str  # HUGGING_FACE, MAPPED, ORBAX or IN_MEMORY
    location: Path | None = None  # the directory; None in memory
    marker: dict = dataclasses.field(default_factory=dict)  # what `convert` recorded; {} otherwise
    declared: CheckpointQuantization | None = None  # a pre-quantized Hugging Face checkpoint's quantization
    stored: dict | None = None  # a converted checkpoint's quantized linear layers (`quantized.stored_layers`)
    turned: bool = False  # linear layers stored feature-major (`turned.py`)
    dtype: str | None = None  # a converted checkpoint's float dtype (else config.json's `torch_dtype` says)
    module: nnx.Module | None = None  # the weights in memory

    @classmethod
    def read(cls, model_dir: str | Path) -> Checkpoint:
        location = Path(model_dir)
        marker = read_json_object(location / MARKER)
        if marker:  # a converted checkpoint: its copied config.json describes its source, not its tensors
            return cls(marker.get("format", ORBAX), location, marker, stored=stored_layers(marker),
                       turned=marker.get("linear_layout") == FEATURE_MAJOR_LAYOUT, dtype=marker.get("dtype"))
        config = read_json_object(location / "config.json")
        declared = detect_checkpoint_quantization(config, location) if config else None
        return cls(HUGGING_FACE, location, declared=declared)

    @classmethod
    def in_memory(cls, module: nnx.Module) -> Checkpoint:
        return cls(IN_MEMORY, module=module)

    @property
    def converted(self) -> bool:
        """Written by `jaxserve convert`."""
        return bool(self.marker)

    @property
    def in_place(self) -> bool:
        """Its tensors become the device arrays where they lie in the mapped files (on a CPU)."""
        return self.format == MAPPED

    @functools.cached_property
    def weight_files(self) -> dict[str, Path]:
        """Tensor name -> the safetensors shard that holds it (read when first asked: planning never asks)."""
        return safetensors_files(self.location)

    def served_config(self, config: ModelConfig, flags: QuantizationFlags, platform: str | None = None) -> ModelConfig:
        """`config` with the linear layers as `flags` ask of this checkpoint, run on `platform` (default: this
        process's backend; `quantized.quantized_config`)."""
        return quantized_config(config, flags, self.declared, self.stored, platform)

    def lies_turned(self, model_config: ModelConfig) -> bool:
        """Whether its linear layers lie as a feature-major engine runs `model_config`'s: stored so, and not
        made at load (the quantizer reads kernels in the model's own layout)."""
        return self.turned and not self._made_at_load(model_config)

    def _made_at_load(self, model_config: ModelConfig) -> bool:
        """The quantized layers `model_config` asks for are made on the host from float or pre-quantized
        tensors, not read as a converted checkpoint stores them."""
        return model_config.linear_quantization is not None and self.stored is None

    def open(self) -> RegionReader | OrbaxReader:
        """The reader of the tensors as they are stored (each reader has `read(entries)`)."""
        if self.format == IN_MEMORY:
            return ModuleReader(self.module)
        if self.format == ORBAX:
            return OrbaxReader(self.location)
        return SafetensorsReader(self.location, own_layout=self.format == MAPPED, files=self.weight_files)

    def reader(self, model: AbstractModel) -> RegionReader | OrbaxReader:
        """The reader that fills `model`'s entries, composed by the rule of the module docstring."""
        spec, at_load = model.config.linear_quantization, self._made_at_load(model.config)
        as_it_lies = model.feature_major and self.lies_turned(model.config)
        if spec is not None:
            logger.info("%s", describe_linear_layers(spec))
        reader = self.open()
        if as_it_lies:
            return reader
        if self.turned:
            as_stored = dataclasses.replace(model.config, linear_quantization=None) if at_load else model.config
            reader = UnturningReader(reader, as_stored, model.dtype)
        if at_load:
            reader = QuantizedLinearReader(reader, spec, self.declared)
        if model.feature_major:
            reader = TurningReader(reader, model.config, model.dtype)
        return reader


def mark_converted(source_dir: str | Path, output: Path, marker: dict) -> None:
    """Copy the model's other files beside converted weights and write the format marker last."""
    for name in COPIED:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, output / name)
    (output / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
