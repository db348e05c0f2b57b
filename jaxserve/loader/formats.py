"""Checkpoint formats: which one a `--model` directory holds, and the reader that serves it.

- A Hugging Face directory: `config.json` beside `model.safetensors` or a sharded index (`safetensors.py`).
- `jaxserve convert --format mapped`: safetensors in the model's own layout and dtype, every tensor
  64-byte aligned, used where it lies in the page cache (`mapped.py` writes it, `safetensors.py` reads it).
- `jaxserve convert --format orbax`: the parameters saved by Orbax, restored into any mesh (`orbax.py`).
A converted directory is marked by `jaxserve_checkpoint.json`, which names its format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxserve.json_files import read_json_object
from jaxserve.loader.orbax import OrbaxReader
from jaxserve.loader.safetensors import SafetensorsReader

MARKER = "jaxserve_checkpoint.json"
# Files a model directory needs besides its weights: a converted checkpoint carries copies.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt")


def checkpoint_marker(model_dir: str | Path) -> dict:
    """What `convert` recorded of a directory it wrote (format, dtype, quantized layers); {} for a Hugging
    Face directory."""
    return read_json_object(Path(model_dir) / MARKER)


def checkpoint_format(model_dir: str | Path) -> str | None:
    """"orbax" or "mapped" for a directory `convert` wrote; None for a Hugging Face one."""
    marker = checkpoint_marker(model_dir)
    return marker.get("format", "orbax") if marker else None


def open_checkpoint(model_dir: str | Path) -> OrbaxReader | SafetensorsReader:
    """The reader for the directory's format (each has `read(entries)`)."""
    fmt = checkpoint_format(model_dir)
    if fmt == "orbax":
        return OrbaxReader(model_dir)
    return SafetensorsReader(model_dir, own_layout=fmt == "mapped")


def mark_converted(source_dir: str | Path, output: Path, marker: dict) -> None:
    """Copy the model's other files beside converted weights and write the format marker last."""
    for name in COPIED:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, output / name)
    (output / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
