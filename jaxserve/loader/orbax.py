"""The Orbax format, for meshes: any mesh restores only the slices its devices need.

1. `save_orbax` saves the parameters (loaded onto the current mesh, each device having read its own
   slices) under DIR/params, in the model's own per-layer layout and true shapes (a dimension that does
   not split evenly is kept whole instead of padded), so the checkpoint does not depend on the mesh that
   wrote it. `convert.py` copies config.json, generation_config.json and the tokenizer files beside it
   and marks the format.
2. `OrbaxReader.read` restores every parameter straight into the *current* mesh's shardings: Orbax reads
   from disk only the slices each device needs, whatever mesh saved the checkpoint. Shapes are padded
   with zeros where the current layout pads (strict=False), and cast to the requested dtype.
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxserve.loader.dtypes import stored_dtype
from jaxserve.loader.placement import ParamEntry
from jaxserve.loader.tree import ParamPath, get_path, nested

PARAMS_DIR = "params"


def save_orbax(arrays: dict[ParamPath, jax.Array], output: Path) -> None:
    import orbax.checkpoint as ocp

    stored = {path: a.astype(stored_dtype(a.dtype)) for path, a in arrays.items()}
    ocp.PyTreeCheckpointer().save(output / PARAMS_DIR, nested(stored))


class OrbaxReader:
    def __init__(self, model_dir: str | Path):
        self.model_dir = model_dir

    @property
    def description(self) -> str:
        return f"{self.model_dir} (Orbax checkpoint)"

    def read(self, entries: list[ParamEntry]) -> dict[ParamPath, jax.Array]:
        import orbax.checkpoint as ocp

        params_dir = (Path(self.model_dir) / PARAMS_DIR).resolve()
        checkpointer = ocp.PyTreeCheckpointer()
        saved = checkpointer.metadata(params_dir)
        saved = getattr(saved, "item_metadata", saved)
        saved = getattr(saved, "tree", saved)
        args = {}
        for e in entries:
            try:
                shape = tuple(get_path(saved, e.path).shape)
            except (KeyError, TypeError):
                raise ValueError(f"Orbax checkpoint {self.model_dir} has no parameter {'/'.join(e.path)}") from None
            if shape != e.layout.shape:
                raise ValueError(f"checkpoint parameter {'/'.join(e.path)} has shape {shape}, the config implies "
                                 f"{e.layout.shape}")
            args[e.path] = ocp.ArrayRestoreArgs(sharding=e.sharding, global_shape=e.layout.padded, strict=False,
                                                dtype=stored_dtype(e.dtype))
        restored = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=nested(args)))
        return {e.path: get_path(restored, e.path).astype(e.dtype) for e in entries}
