"""The feature-major layout, stored: a mapped checkpoint whose linear layers lie as a CPU's fastest products
read them (weights [out, in], q/k/v and gate/up fused, int8 codes [out, in]: jaxserve/model/feature_major.py).

A mapped checkpoint is used where it lies (`mapped.py`); turning its layers at every start would copy the
model (the 124.7M model: 0.7-0.9 s more and 1.5x the peak memory; docs/performance.md, "Feature-major
products"). So `jaxserve convert --format mapped` on a CPU stores them turned, and the marker says so.

- `turned_parts`: each parameter of the turned model, and the parameters of the model's own layout it is made of.
- `TurningReader`: a reader of the model's own layout as the turned parameters (what `convert` writes).
- `UnturningReader`: a turned checkpoint as the model's own layout, for an engine that does not run
  feature-major (a GPU, a mesh, another `--cpu-matmul-library`, a notebook's `load_model`). It copies.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.loader.abstract import AbstractModel
from jaxserve.loader.placement import RegionReader
from jaxserve.loader.tree import ParamPath
from jaxserve.model.feature_major import FeatureMajorLinear, FusedProjections
from jaxserve.model.quantized_linear import QuantizedLinear

FEATURE_MAJOR_LAYOUT = "feature-major"  # the marker's `linear_layout` (absent: the model's own layout)


@dataclasses.dataclass(frozen=True)
class Part:
    """A parameter of the model's own layout inside a turned one. A transposed part (a kernel or int8 codes,
    [..., in, out] there) fills rows `start` .. `start + out` of the turned weight's axis -2; any other (a
    bias, an untouched parameter) fills that range of the last axis."""
    source: ParamPath
    shape: tuple[int, ...]  # in the model's own layout
    start: int = 0
    transposed: bool = False

    def region(self, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The turned parameter's region that holds `index` of this part (as `self.shape` indexes it),
        transposed back where the part is."""
        full = [slice(*s.indices(n)[:2]) for s, n in zip(index, self.shape)]
        last = slice(full[-1].start + self.start, full[-1].stop + self.start)
        return (*full[:-2], last, full[-2]) if self.transposed else (*full[:-1], last)


def turned_parts(config: ModelConfig, dtype) -> dict[ParamPath, tuple[Part, ...]]:
    """Every parameter path of the turned model -> the parts of the model's own layout it is made of."""
    own = {path: tuple(spec.shape) for path, spec in AbstractModel(config, dtype).params}
    turned = AbstractModel(config, dtype, feature_major=True)
    parts: dict[ParamPath, tuple[Part, ...]] = {}
    for node_path, node in nnx.iter_graph(turned.module):
        at = tuple(str(p) for p in node_path)
        if isinstance(node, FusedProjections):
            owner, starts = at[:-1], np.cumsum((0,) + node.sizes[:-1])
            parts[at + ("weight",)] = tuple(Part(owner + (name, "kernel"), own[owner + (name, "kernel")], int(start),
                                                 True) for name, start in zip(node.names, starts))
            if node.bias is not None:
                parts[at + ("bias",)] = tuple(Part(owner + (name, "bias"), own[owner + (name, "bias")], int(start))
                                              for name, start in zip(node.names, starts))
        elif isinstance(node, FeatureMajorLinear):
            parts[at + ("weight",)] = (Part(at + ("kernel",), own[at + ("kernel",)], 0, True),)
        elif isinstance(node, QuantizedLinear) and node.codes_out_in:
            parts[at + ("codes",)] = (Part(at + ("codes",), own[at + ("codes",)], 0, True),)
    for path, spec in turned.params:
        parts.setdefault(path, (Part(path, tuple(spec.shape)),))
    return parts


def turned_shape(parts: tuple[Part, ...]) -> tuple[int, ...]:
    """The shape of the turned parameter made of `parts`: their outputs stacked on its axis -2 (transposed
    parts) or on its last axis."""
    first, extent = parts[0], sum(part.shape[-1] for part in parts)
    return (*first.shape[:-2], extent, first.shape[-2]) if first.transposed else (*first.shape[:-1], extent)


def _kept(parts: tuple[Part, ...]) -> Part | None:
    """The one part of a parameter the turning left as it was, or None."""
    return parts[0] if len(parts) == 1 and not parts[0].transposed else None


class TurningReader(RegionReader):
    """`base`, a reader of the model's own layout, read as the turned model's parameters. A turned parameter
    is assembled whole from its parts, then the asked region is copied out (`convert` asks for whole ones)."""

    def __init__(self, base: RegionReader, config: ModelConfig, dtype):
        self.base, self.parts = base, turned_parts(config, dtype)

    @property
    def description(self) -> str:
        return self.base.description

    def expect(self, shapes: dict[ParamPath, tuple[int, ...]]) -> None:
        self.base.expect({p.source: p.shape for path in shapes for p in self.parts[path]})

    def reader(self, path: ParamPath, shape: tuple[int, ...]):
        parts = self.parts[path]
        if _kept(parts):
            return self.base.reader(path, shape)

        def fill(index, out):
            whole = np.empty(shape, out.dtype)
            for part in parts:
                source = np.empty(part.shape, out.dtype)
                self.base.reader(part.source, part.shape)(tuple(slice(None) for _ in part.shape), source)
                region = part.region(tuple(slice(None) for _ in part.shape))
                whole[region] = np.swapaxes(source, -1, -2) if part.transposed else source
            np.copyto(out, whole[index])
        return fill

    def in_place(self, path: ParamPath, dtype):
        return self.base.in_place(path, dtype) if _kept(self.parts[path]) else None

    def close(self) -> None:
        self.base.close()


class UnturningReader(RegionReader):
    """`base`, a reader of a turned checkpoint, read as the model's own layout: each region is read from its
    turned parameter and transposed back. Parameters the turning left as they were are read as they lie."""

    def __init__(self, base: RegionReader, config: ModelConfig, dtype):
        self.base, parts = base, turned_parts(config, dtype)
        self.turned_shapes = {path: turned_shape(p) for path, p in parts.items()}
        self.home = {part.source: (path, part) for path, p in parts.items() for part in p}

    @property
    def description(self) -> str:
        return f"{self.base.description}, turned back from the feature-major layout"

    def expect(self, shapes: dict[ParamPath, tuple[int, ...]]) -> None:
        self.base.expect({self.home[path][0]: self.turned_shapes[self.home[path][0]] for path in shapes})

    def reader(self, path: ParamPath, shape: tuple[int, ...]):
        turned, part = self.home[path]
        read = self.base.reader(turned, self.turned_shapes[turned])
        if not part.transposed:
            return lambda index, out: read(part.region(index), out)

        def fill(index, out):
            region = np.empty(out.shape[:-2] + out.shape[:-3:-1], out.dtype)
            read(part.region(index), region)
            np.copyto(out, np.swapaxes(region, -1, -2))
        return fill

    def in_place(self, path: ParamPath, dtype):
        turned, parts = self.home[path][0], (self.home[path][1],)
        return self.base.in_place(path, dtype) if turned == path and _kept(parts) else None

    def close(self) -> None:
        self.base.close()

