"""Vision encoders' weights from a vision-language checkpoint, by their Hugging Face tensor names.

1. `load_vision_encoder(model_dir)` reads config.json, builds the family's encoder (`VISION_ENCODERS`) as
   shapes only, and fills every parameter from the checkpoint's memory-mapped safetensors files.
2. A parameter's tensor name is its module path joined with dots (the encoders name their modules as the
   checkpoints do), its leaf renamed (`kernel` -> `weight`, `embedding` -> `weight`), after the family's
   prefix: checkpoints written by transformers 5 say `model.vision_tower.` / `model.visual.`, hub files
   written by transformers 4 `vision_tower.vision_model.` / `visual.`; each is tried in turn.
3. Linear kernels are transposed ([out, in] -> [in, out]); a patch convolution's [D, C, (T,) P, P] kernel
   is flattened to the [C * (T *) P * P, D] matmul the encoders use. Shapes that disagree with config.json
   are errors naming the tensor. The encoder runs replicated (it is small next to the language model).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.json_files import read_json_object
from jaxserve.loader.safetensors import SafetensorsFile, safetensors_files
from jaxserve.loader.tree import flatten, nested
from jaxserve.model.qwen_vit import Qwen25VisionEncoder
from jaxserve.model.siglip import Gemma3VisionEncoder
from jaxserve.vision_config import vision_config

# model_type -> (encoder class, {first path element: checkpoint prefixes, most specific first},
#                {module name: checkpoint name} for the few modules named differently)
VISION_ENCODERS = {
    "gemma3": (Gemma3VisionEncoder,
               {"vision_tower": ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                                 "model.vision_tower.", "vision_tower."),
                "multi_modal_projector": ("model.multi_modal_projector.", "multi_modal_projector.")},
               {}),
    "qwen2_5_vl": (Qwen25VisionEncoder, {"": ("model.visual.", "visual.")},
                   {"patch_embed.": "patch_embed.proj.", "merger.fc1.": "merger.mlp.0.",
                    "merger.fc2.": "merger.mlp.2."}),
}
LEAF_NAMES = {"kernel": "weight", "embedding": "weight"}


def candidate_names(path: tuple[str, ...], prefixes: dict, renames: dict) -> list[str]:
    """The checkpoint names a parameter may have, in the order they are tried."""
    *modules, leaf = path
    name = ".".join([*modules, LEAF_NAMES.get(leaf, leaf)])
    for ours, theirs in renames.items():
        name = name.replace(ours, theirs)
    top = path[0] if path[0] in prefixes else ""
    if top:
        name = name[len(top) + 1:]
    return [prefix + name for prefix in prefixes[top]]


def as_param(stored: np.ndarray, leaf: str, shape: tuple[int, ...], name: str, model_dir: Path) -> np.ndarray:
    """A stored tensor in the parameter's layout: linear and patch kernels turned [in, out]."""
    value = stored.reshape(stored.shape[0], -1).T if leaf == "kernel" else stored
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"weight {name!r} in {model_dir} has shape {tuple(stored.shape)}, which does not give the "
                         f"{tuple(shape)} that config.json implies (is config.json from another model?)")
    return value


def load_vision_encoder(model_dir: str | Path, dtype=jnp.float32) -> nnx.Module:
    """The checkpoint's vision encoder with its weights, in `dtype`, on the default device."""
    model_dir = Path(model_dir)
    cfg = read_json_object(model_dir / "config.json", required=True)
    if cfg.get("model_type") not in VISION_ENCODERS:
        raise ValueError(f"{model_dir}: model_type {cfg.get('model_type')!r} has no vision encoder jaxserve runs "
                         f"({', '.join(VISION_ENCODERS)})")
    cls, prefixes, renames = VISION_ENCODERS[cfg["model_type"]]
    config = vision_config(cfg)
    abstract = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    files = safetensors_files(model_dir)
    opened: dict[Path, SafetensorsFile] = {}
    values = {}
    try:
        for key, spec in flatten(nnx.to_pure_dict(state)):
            path = tuple(str(p) for p in key)  # list indices are ints in the state
            names = candidate_names(path, prefixes, renames)
            name = next((n for n in names if n in files), None)
            if name is None:
                raise ValueError(f"checkpoint {model_dir} is missing vision tensor {names[-1]!r} "
                                 f"(looked for {' / '.join(names)})")
            file = opened.get(files[name]) or opened.setdefault(files[name], SafetensorsFile(files[name]))
            stored = as_param(file.view(name), path[-1], spec.shape, name, model_dir)
            # A copy in the encoder's dtype: nothing keeps pointing into the mapping once it is closed.
            values[key] = jnp.asarray(np.array(stored, dtype=np.dtype(dtype)))
    finally:
        for file in opened.values():
            file.close()
    nnx.replace_by_pure_dict(state, nested(values))
    return nnx.merge(graphdef, state)
