"""`jaxserve convert`: a Hugging Face checkpoint rewritten in a format that `--model DIR` serves faster.

1. `orbax` (the default) is for meshes: the parameters are loaded onto the current mesh (each device
   reading its own slices) and saved by Orbax in the model's own layout (`orbax.py`).
2. `mapped` is for fast starts: safetensors in the model's own layout and dtype, aligned for use in
   place (`mapped.py`); written by one process.
3. Either way the tokenizer and config files are copied beside the weights and the directory is marked
   with its format (`formats.py`), last, so a half-written directory is never taken for a checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.loader.dtypes import DTYPES
from jaxserve.loader.formats import mark_converted
from jaxserve.loader.mapped import write_mapped
from jaxserve.loader.orbax import PARAMS_DIR, save_orbax
from jaxserve.loader.placement import param_entries
from jaxserve.loader.quantized import checkpoint_quantization
from jaxserve.loader.safetensors import SafetensorsReader
from sharding import ParallelConfig, make_plan

logger = logging.getLogger(__name__)


def convert(model_dir: str | Path, output: str | Path, dtype_request: str = "auto",
            parallel: ParallelConfig | None = None, format: str = "orbax") -> Path:
    """Hugging Face directory -> an Orbax or a mapped checkpoint directory (see the module docstring)."""
    config = ModelConfig.from_pretrained(model_dir)
    quantized = checkpoint_quantization(model_dir)
    if quantized is not None:  # its codes would be read as float weights, without their scales
        raise ValueError(f"{model_dir} is a pre-quantized checkpoint ({quantized.summary}): the converted formats "
                         f"do not store quantized tensors yet; serve the Hugging Face directory itself")
    # Keep the checkpoint's own precision unless asked otherwise (`auto` here does not mean "f32 on CPU").
    name = str(config.torch_dtype).removeprefix("torch.") if dtype_request == "auto" else dtype_request
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype_request!r}")
    if format not in ("orbax", "mapped"):
        raise ValueError(f"format must be orbax or mapped; got {format!r}")
    if format == "mapped" and jax.process_count() > 1:
        raise ValueError("--format mapped is written by one process: run convert on one host")
    output = _new_dir(output)
    if format == "mapped":
        count = write_mapped(model_dir, output, DTYPES[name])
        mark_converted(model_dir, output, {"format": "mapped", "dtype": jnp.dtype(DTYPES[name]).name})
    else:
        plan = make_plan(parallel or ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                         num_kv_heads=config.num_kv_heads)
        entries = param_entries(config, DTYPES[name], plan, pad=False)
        save_orbax(SafetensorsReader(model_dir).read(entries), output)
        count = len(entries)
        if jax.process_index() == 0:
            mark_converted(model_dir, output, {"format": "orbax", "params": PARAMS_DIR,
                                               "dtype": jnp.dtype(DTYPES[name]).name})
    logger.info("wrote %s checkpoint %s (%d tensors, %s) from %s", format, output, count, name, model_dir)
    return output


def _new_dir(output: str | Path) -> Path:
    output = Path(output).resolve()
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output directory {output} exists and is not empty")
    output.mkdir(parents=True, exist_ok=True)
    return output
