"""Converted checkpoints: `jaxserve convert` writes one, `--model DIR` serves from it. Two formats:

- `orbax` (the default) is for meshes: any mesh restores only the slices its devices need.
- `mapped` is for fast starts: safetensors files in the model's own layout and dtype (linear kernels
  [in, out], named by parameter path), every tensor 64-byte aligned, so that the loader uses each tensor
  where it lies in the memory-mapped file (see `weights.py`), as llama.cpp does with a GGUF file.

The Orbax format:

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
import math
import shutil
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

MARKER = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
# Files a model directory needs besides its weights.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "chat_template.jinja", "vocab.json", "merges.txt")


def checkpoint_format(model_dir: str | Path) -> str | None:
    """"orbax" or "mapped" for a directory `convert` wrote; None for a Hugging Face one."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text()).get("format", "orbax")


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

    output = _new_dir(output)
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(output / PARAMS_DIR, _nested(arrays))
    if jax.process_index() == 0:
        _finish(source_dir, output, {"format": "orbax", "params": PARAMS_DIR, "dtype": dtype_name})


def _finish(source_dir: str | Path, output: Path, marker: dict) -> None:
    for name in COPIED:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, output / name)
    (output / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


MAPPED_SHARD_BYTES = 4 << 30  # tensors per file, at most (one tensor bigger than this gets a file alone)


def save_mapped(model_dir: str | Path, output: str | Path, dtype) -> int:
    """Write the `mapped` format from a Hugging Face directory, one tensor in memory at a time; returns the
    number of tensors. Each file is a valid safetensors file: the header is padded with spaces to a
    multiple of 64 bytes, and a tensor whose size is not a multiple of 64 is followed by a small padding
    tensor (`__pad__.N`), so that every tensor's data starts 64-byte aligned."""
    import numpy as np

    from jaxserve.config import ModelConfig
    from jaxserve.weights import (SAFETENSORS_CODES, SafetensorsReader, _flatten, abstract_model, loading_progress,
                                  param_tensor_name)
    from sharding.loading import HOST_ALIGNMENT, host_buffer

    output = _new_dir(output)
    from flax import nnx
    _, state = nnx.split(abstract_model(ModelConfig.from_pretrained(model_dir), dtype))
    params = [(path, tuple(spec.shape)) for path, spec in _flatten(nnx.to_pure_dict(state))]
    dtype = np.dtype(dtype)
    shards: list[list] = [[]]
    filled = 0  # bytes in the last shard
    for path, shape in params:
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and filled + size > MAPPED_SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append((path, shape, size))
        filled += size
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    reader, weight_map = SafetensorsReader(model_dir), {}
    try:
        with loading_progress(len(params)) as bar:
            for name, shard in zip(names, shards):
                header, offset, pad = {"__metadata__": {"format": "jaxserve", "layout": "nnx"}}, 0, 0
                for path, shape, size in shard:
                    header[param_tensor_name(path)] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                                                       "data_offsets": [offset, offset + size]}
                    weight_map[param_tensor_name(path)] = name
                    offset += size
                    if offset % HOST_ALIGNMENT:
                        gap = HOST_ALIGNMENT - offset % HOST_ALIGNMENT
                        header[f"__pad__.{pad}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
                        offset, pad = offset + gap, pad + 1
                encoded = json.dumps(header).encode()
                encoded += b" " * (-(8 + len(encoded)) % HOST_ALIGNMENT)
                with open(output / name, "wb") as f:
                    f.write(len(encoded).to_bytes(8, "little") + encoded)
                    for path, shape, _ in shard:
                        data = host_buffer(shape, dtype)
                        reader.reader(path, shape)(tuple(slice(None) for _ in shape), data)
                        f.write(memoryview(data.reshape(-1).view(np.uint8)))
                        if f.tell() % HOST_ALIGNMENT:
                            f.write(b"\0" * (HOST_ALIGNMENT - f.tell() % HOST_ALIGNMENT))
                        bar.update()
    finally:
        reader.close()
    if len(shards) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    _finish(model_dir, output, {"format": "mapped", "dtype": dtype.name})
    return len(params)


def _new_dir(output: str | Path) -> Path:
    output = Path(output).resolve()
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output directory {output} exists and is not empty")
    output.mkdir(parents=True, exist_ok=True)
    return output


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


def convert(model_dir: str | Path, output: str | Path, dtype_request: str = "auto", parallel=None,
            format: str = "orbax") -> Path:
    """Hugging Face directory -> an Orbax or a mapped checkpoint directory (see the module docstring)."""
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
    if format == "mapped":
        if jax.process_count() > 1:
            raise ValueError("--format mapped is written by one process: run convert on one host")
        count = save_mapped(model_dir, output, DTYPES[name])
        logger.info("wrote mapped checkpoint %s (%d tensors, %s) from %s", output, count, name, model_dir)
        return Path(output)
    if format != "orbax":
        raise ValueError(f"format must be orbax or mapped; got {format!r}")
    plan = make_plan(parallel or ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    entries = param_entries(config, DTYPES[name], plan, pad=False)
    arrays = fill_from_reader(entries, SafetensorsReader(model_dir))
    save(arrays, model_dir, output, jnp.dtype(DTYPES[name]).name)
    logger.info("wrote Orbax checkpoint %s (%d tensors, %s) from %s", output, len(entries), name, model_dir)
    return Path(output)
