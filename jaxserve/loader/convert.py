"""`jaxserve convert`: a Hugging Face checkpoint rewritten in a format that `--model DIR` serves faster.

1. `orbax` (the default) is for meshes: the parameters are loaded onto the current mesh (each device
   reading its own slices) and saved by Orbax in the model's own layout (`orbax.py`).
2. `mapped` is for fast starts: safetensors in the model's own layout and dtype, aligned for use in
   place (`mapped.py`); written by one process. Converted on a CPU, a model whose products a CPU runs
   feature-major is stored so (`linear_layout`, `turned.py`), so that a start uses it where it lies.
3. Either way the tokenizer and config files are copied beside the weights and the directory is marked
   with its format (`formats.py`), last, so a half-written directory is never taken for a checkpoint.
4. Quantized linear layers are stored as they run, in either format: quantized here (`quantization`, as
   `--quantization` would at every load) or read from a pre-quantized checkpoint (compressed-tensors, AWQ,
   GPTQ). The marker says how (`quantized.describe_stored`), so a start reads codes and scales as
   they lie and quantizes nothing.
5. The tensors are read as a serving start reads them (`formats.Checkpoint.reader`), for the abstract model
   of the layout being written (`abstract.py`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.dtypes import DTYPES
from jaxserve.loader.formats import Checkpoint, mark_converted
from jaxserve.loader.mapped import write_mapped
from jaxserve.loader.orbax import PARAMS_DIR, save_orbax
from jaxserve.loader.quantized import QuantizationFlags, describe_stored, made_for_float_activations, requantizes
from jaxserve.loader.turned import FEATURE_MAJOR_LAYOUT
from jaxserve.model.feature_major import turning_pays
from sharding import ParallelConfig, make_plan

logger = logging.getLogger(__name__)

LINEAR_LAYOUTS = ("auto", "model", FEATURE_MAJOR_LAYOUT)


def convert(model_dir: str | Path, output: str | Path, dtype_request: str = "auto",
            parallel: ParallelConfig | None = None, format: str = "orbax", quantization: str | None = None,
            quantize_lm_head: bool = False, quantize_embedding: bool = False, linear_layout: str = "auto") -> Path:
    """Hugging Face directory -> an Orbax or a mapped checkpoint directory (see the module docstring).
    `quantization`, `quantize_lm_head`, `quantize_embedding`: as the same flags at a load. `linear_layout`
    (mapped only): `feature-major` stores the linear layers as a CPU runs them, `model` in the model's own
    layout, `auto` the first on a CPU for a model that runs so there by default (`turning_pays`)."""
    checkpoint = Checkpoint.read(model_dir)
    if checkpoint.converted:
        raise ValueError(f"{model_dir} is already a converted checkpoint: convert from the Hugging Face directory")
    config = ModelConfig.from_pretrained(model_dir)
    # Keep the checkpoint's own precision unless asked otherwise (`auto` here does not mean "f32 on CPU").
    name = str(config.torch_dtype).removeprefix("torch.") if dtype_request == "auto" else dtype_request
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype_request!r}")
    if format not in ("orbax", "mapped"):
        raise ValueError(f"format must be orbax or mapped; got {format!r}")
    if format == "mapped" and jax.process_count() > 1:
        raise ValueError("--format mapped is written by one process: run convert on one host")
    if linear_layout not in LINEAR_LAYOUTS:
        raise ValueError(f"linear_layout must be one of {', '.join(LINEAR_LAYOUTS)}; got {linear_layout!r}")
    if linear_layout == FEATURE_MAJOR_LAYOUT and format != "mapped":
        raise ValueError("--linear-layout feature-major is stored by --format mapped only (Orbax is for meshes, "
                         "and feature-major layers run on one device)")
    flags = QuantizationFlags(quantization, lm_head=quantize_lm_head, embedding=quantize_embedding)
    config = checkpoint.served_config(config, flags)
    spec, dtype = config.linear_quantization, DTYPES[name]
    output = _new_dir(output)
    marker = {"format": format, "dtype": jnp.dtype(dtype).name}
    if spec is not None:
        declared = checkpoint.declared
        marker["linear_quantization"] = describe_stored(
            spec, made_for_float_activations(declared) and not requantizes(quantization, declared))
    if format == "mapped":
        turned = linear_layout == FEATURE_MAJOR_LAYOUT or (
            linear_layout == "auto" and jax.default_backend() == "cpu" and turning_pays(config, dtype, 1))
        if turned:
            marker["linear_layout"] = FEATURE_MAJOR_LAYOUT
        model = AbstractModel(config, dtype, feature_major=turned)
        count = write_mapped(checkpoint.reader(model), model.params, output)
        mark_converted(model_dir, output, marker)
    else:
        plan = make_plan(parallel or ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                         num_kv_heads=config.num_kv_heads)
        model = AbstractModel(config, dtype, plan, pad=False)
        save_orbax(checkpoint.reader(model).read(model.entries), output)
        count = len(model.entries)
        if jax.process_index() == 0:
            mark_converted(model_dir, output, {**marker, "params": PARAMS_DIR})
    logger.info("wrote %s checkpoint %s (%d tensors, %s%s%s) from %s", format, output, count, name,
                f", linear layers {spec.codes}" if spec else "",
                ", linear layers feature-major" if marker.get("linear_layout") else "", model_dir)
    return output


def _new_dir(output: str | Path) -> Path:
    output = Path(output).resolve()
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output directory {output} exists and is not empty")
    output.mkdir(parents=True, exist_ok=True)
    return output
