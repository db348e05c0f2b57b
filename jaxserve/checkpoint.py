"""Orbax checkpoints: `jaxserve convert` writes one, `--model DIR` serves from it.

1. `convert` loads a Hugging Face checkpoint onto the current mesh (each device reading its own slices)
   and saves the parameters with Orbax under DIR/params, in the model's own per-layer layout and true
   shapes (a dimension that does not split evenly is kept whole instead of padded), so the checkpoint
   does not depend on the mesh that wrote it. config.json, generation_config.json and the tokenizer
   files are copied beside it, and DIR/jaxserve_checkpoint.json marks the format.
2. `restore_arrays` restores every parameter straight into the *current* mesh's shardings: Orbax reads
   from disk only the slices each device needs, whatever mesh saved the checkpoint. Shapes are padded
   with zeros where the current layout pads (strict=False), and cast to the requested dtype.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

MARKER = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
# Files a model directory needs besides its weights.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt")


def is_orbax_checkpoint(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def _nested(flat: dict[tuple[str, ...], object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def save(arrays: dict[tuple[str, ...], jax.Array], source_dir: str | Path, output: str | Path, dtype_name: str) -> None:
    import orbax.checkpoint as ocp

    output = Path(output).resolve()
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output directory {output} exists and is not empty")
    output.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(output / PARAMS_DIR, _nested(arrays))
    if jax.process_index() == 0:
        for name in COPIED:
            if (Path(source_dir) / name).is_file():
                shutil.copy2(Path(source_dir) / name, output / name)
        (output / MARKER).write_text(json.dumps({"format": "orbax", "params": PARAMS_DIR, "dtype": dtype_name},
                                                indent=1) + "\n")


def restore_arrays(model_dir: str | Path, entries) -> dict[tuple[str, ...], jax.Array]:
    import orbax.checkpoint as ocp

    params_dir = (Path(model_dir) / PARAMS_DIR).resolve()
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(params_dir)
    saved = getattr(saved, "item_metadata", saved)
    saved = getattr(saved, "tree", saved)
    args = {}
    for e in entries:
        try:
            shape = tuple(_get(saved, e.path).shape)
        except (KeyError, TypeError):
            raise ValueError(f"Orbax checkpoint {model_dir} has no parameter {'/'.join(e.path)}") from None
        if shape != e.layout.shape:
            raise ValueError(f"checkpoint parameter {'/'.join(e.path)} has shape {shape}, the config implies "
                             f"{e.layout.shape}")
        args[e.path] = ocp.ArrayRestoreArgs(sharding=e.sharding, global_shape=e.layout.padded, strict=False,
                                            dtype=e.dtype)
    restored = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=_nested(args)))
    return {e.path: _get(restored, e.path) for e in entries}


def convert(model_dir: str | Path, output: str | Path, dtype_request: str = "auto", parallel=None) -> Path:
    """Hugging Face directory -> Orbax checkpoint directory (see the module docstring)."""
    import jax.numpy as jnp

    from jaxserve.config import ModelConfig
    from jaxserve.sharded_model import fill_from_reader, param_entries
    from jaxserve.weights import DTYPES, SafetensorsReader
    from sharding import ParallelConfig, make_plan

    config = ModelConfig.from_pretrained(model_dir)
    # Keep the checkpoint's own precision unless asked otherwise (`auto` here does not mean "f32 on CPU").
    name = str(config.torch_dtype).removeprefix("torch.") if dtype_request == "auto" else dtype_request
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype_request!r}")
    plan = make_plan(parallel or ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    entries = param_entries(config, DTYPES[name], plan, pad=False)
    arrays = fill_from_reader(entries, SafetensorsReader(model_dir))
    save(arrays, model_dir, output, jnp.dtype(DTYPES[name]).name)
    logger.info("wrote Orbax checkpoint %s (%d tensors, %s) from %s", output, len(entries), name, model_dir)
    return Path(output)
