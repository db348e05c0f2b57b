"""Weights: Hugging Face safetensors read by parameter path, as whole tensors or as slices.

1. Build the model abstractly (`nnx.eval_shape`: no memory, no random init) to learn every parameter's
   path, shape and dtype.
2. Map each parameter path to its Hugging Face tensor name (`model.layers.0.self_attn.q_proj.weight`),
   find the file that holds it (single file or `model.safetensors.index.json`) and hand out a reader
   for any region of it: `get_slice` reads only that region (transposed for linear kernels, which HF
   stores [out, in]). The engine's sharded loader (`sharded_model.py`) asks each device's slice.
3. `load_model` reads whole tensors into one unsharded module (notebooks, single-device tools).
   Missing tensors and shape mismatches are errors that name the tensor.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxserve.config import ModelConfig
from jaxserve.models import model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(requested: str, config: ModelConfig, platform: str | None = None):
    """`auto` follows the checkpoint on accelerators; on CPU it uses float32 (bf16 matmuls crawl there)."""
    if requested == "auto":
        platform = platform or jax.default_backend()
        if platform == "cpu":
            return jnp.float32
        return DTYPES.get(str(config.torch_dtype).removeprefix("torch."), jnp.bfloat16)
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {requested!r}")
    return DTYPES[requested]


def hf_tensor_name(path: tuple) -> tuple[str, bool]:
    """NNX parameter path -> (Hugging Face tensor name, whether to transpose)."""
    *module_path, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    name = ".".join(module_path + [leaf])
    return (name if name.startswith("lm_head") else f"model.{name}"), transpose


def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index of a sharded checkpoint or the single file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    with safe_open(single, framework="flax") as f:
        return {name: single for name in f.keys()}


def abstract_model(config: ModelConfig, dtype):
    cls = model_class(config)
    return nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))


class SafetensorsReader:
    """Slices of Hugging Face tensors by NNX parameter path, read with `get_slice` (never the whole file)."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = safetensors_files(self.model_dir)
        self._handles: dict[Path, object] = {}

    def _slice(self, path: tuple):
        name, transpose = hf_tensor_name(path)
        if name not in self.files:
            raise ValueError(f"checkpoint {self.model_dir} is missing tensor {name!r}")
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="np").__enter__()
        return name, transpose, self._handles[file].get_slice(name)

    def reader(self, path: tuple, shape: tuple[int, ...]):
        """A function index -> numpy region of the parameter at `path` (NNX layout, [in, out] kernels)."""
        name, transpose, view = self._slice(path)
        stored = tuple(view.get_shape())
        if (stored[::-1] if transpose else stored) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {stored}, the config implies "
                             f"{tuple(shape[::-1]) if transpose else tuple(shape)}")
        if transpose:  # HF stores linear weights [out, in]
            return lambda index: view[index[1], index[0]].T
        return lambda index: view[index] if index else view[:]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


class ModuleReader:
    """Slices of an in-memory module's parameters (the built-in demo model, tests)."""

    def __init__(self, module: nnx.Module):
        self.params = {tuple(str(p) for p in path): value for path, value in
                       _flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param)))}

    def reader(self, path: tuple, shape: tuple[int, ...]):
        value = np.asarray(self.params[tuple(str(p) for p in path)])
        if value.shape != tuple(shape):
            raise ValueError(f"parameter {'/'.join(map(str, path))} has shape {value.shape}, expected {shape}")
        return lambda index: value[index]

    def close(self) -> None:
        self.params.clear()


def loading_progress(items: list):
    """The weight-loading progress bar (on stderr), shared by the sharded and the single-device loaders."""
    return tqdm(items, desc="Loading weights", unit="tensor")


def load_model(model_dir: str | Path, config: ModelConfig, dtype) -> nnx.Module:
    """The whole model on the default device (unsharded): for notebooks and single-device tools."""
    model_dir = Path(model_dir)
    graphdef, state = nnx.split(abstract_model(config, dtype))
    wanted = nnx.to_pure_dict(state)
    source = SafetensorsReader(model_dir)
    start = time.perf_counter()
    try:
        for path, spec in loading_progress(list(_flatten(wanted))):
            read = source.reader(path, spec.shape)
            _set(wanted, path, jnp.asarray(read(tuple(slice(None) for _ in spec.shape)), dtype=spec.dtype))
    finally:
        source.close()
    nnx.replace_by_pure_dict(state, wanted)
    logger.info("loaded %s as %s in %.1fs", model_dir, jnp.dtype(dtype).name, time.perf_counter() - start)
    return nnx.merge(graphdef, state)


def random_model(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> nnx.Module:
    """Randomly initialised weights (deterministic in `seed`), for the built-in demo model and tests."""
    return model_class(config)(config, dtype=dtype, rngs=nnx.Rngs(seed))


def _flatten(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
