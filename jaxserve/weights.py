"""Weights: Hugging Face safetensors straight into device arrays of the chosen dtype.

1. Build the model abstractly (`nnx.eval_shape`: no memory, no random init) to learn every parameter's
   path, shape and dtype.
2. Map each parameter path to its Hugging Face tensor name (`model.layers.0.self_attn.q_proj.weight`),
   find the file that holds it (single file or `model.safetensors.index.json`), read it, transpose
   linear kernels (HF stores [out, in]) and cast to the target dtype.
3. Merge into a live module. Missing tensors and shape mismatches are errors that name the tensor.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
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


def load_model(model_dir: str | Path, config: ModelConfig, dtype) -> nnx.Module:
    model_dir = Path(model_dir)
    graphdef, state = nnx.split(abstract_model(config, dtype))
    wanted = nnx.to_pure_dict(state)
    files = safetensors_files(model_dir)
    flat = list(_flatten(wanted))
    start = time.perf_counter()
    handles: dict[Path, object] = {}
    loaded_bytes = 0
    try:
        for path, spec in tqdm(flat, desc="Loading weights", unit="tensor", disable=len(flat) < 50):
            name, transpose = hf_tensor_name(path)
            if name not in files:
                raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}")
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="flax").__enter__()
            tensor = handles[file].get_tensor(name)
            if transpose:
                tensor = tensor.T
            if tensor.shape != spec.shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(spec.shape)}")
            value = jnp.asarray(tensor, dtype=spec.dtype)
            loaded_bytes += value.size * value.dtype.itemsize
            _set(wanted, path, value)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    nnx.replace_by_pure_dict(state, wanted)
    logger.info("loaded %d tensors (%.1f MB) from %s as %s in %.1fs", len(flat), loaded_bytes / 1e6,
                model_dir, jnp.dtype(dtype).name, time.perf_counter() - start)
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
