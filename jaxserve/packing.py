"""Per-step device inputs as dataclasses whose packing into the step's transfer buffers follows from
their fields.

A step sends its inputs to the device as two flat host buffers, one int32 and one float32: one transfer
each, whatever the number of fields. Each field of a packed dataclass declares its shape in the step's
dimensions and its dtype (`packed(...)`), so the offsets, the host views that fill the buffers and the
slices that the jitted step reads back are all derived from the declaration:

1. `Packing(cls, dims)` lays the fields (nested packed dataclasses included) out in declaration order,
   int32 and uint32 fields in the int buffer, float32 fields in the float buffer. A field whose dimensions
   make it empty is absent (None, no slice in the program): an input only some models have (M-RoPE's
   positions) costs the others nothing, their programs stay as they were.
2. On the host, `empty()` gives two buffers holding every field's fill value and `views(ints, floats)` an
   instance of the dataclass whose leaves are numpy views into them: writing a view fills the buffer.
3. Inside the jitted step, `unpack(ints, floats)` gives an instance whose leaves are static slices of
   the two buffers (free), uint32 fields bitcast back from their int32 storage.
4. A field may name its per-sequence `source`: an attribute path (or a function) of a scheduled sequence
   (`jaxserve/scheduling/step.py`), which the batch builder copies into rows 0..n-1. Adding such a field
   is one line in its dataclass; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from typing import Any, Callable

import numpy as np

_INT, _FLOAT = "ints", "floats"
_STORED = {np.dtype(np.int32): _INT, np.dtype(np.uint32): _INT, np.dtype(np.float32): _FLOAT}


@dataclasses.dataclass(frozen=True)
class PackedField:
    shape: tuple[str, ...]  # dimension expressions: "T", "S", "S+1", "P", "2", ...; () for a scalar
    dtype: np.dtype
    fill: float | str  # the value of padding rows and of an empty step (a number, or a dimension's name)
    source: Callable[[Any], Any] | None  # per-sequence value (rows 0..n-1), for the batch builder


def packed(shape: str, dtype=np.int32, fill: float | str = 0, source: str | Callable | None = None):
    """A packed field: `shape` is comma-separated dimension expressions ("T", "S+1", "S,P"; "" for a scalar)."""
    dims = tuple(d.strip() for d in shape.split(",") if d.strip())
    dtype = np.dtype(dtype)
    if dtype not in _STORED:
        raise TypeError(f"packed fields are int32, uint32 or float32, not {dtype}")
    getter = operator.attrgetter(source) if isinstance(source, str) else source
    return dataclasses.field(metadata={"packed": PackedField(dims, dtype, fill, getter)})


def per_token(dtype=np.int32, fill: float | str = 0):
    return packed("T", dtype, fill)


def per_seq(dtype=np.int32, fill: float | str = 0, source: str | Callable | None = None):
    return packed("S", dtype, fill, source)


def _size(expression: str, dims: dict[str, int]) -> int:
    return sum(int(term) if term.isdigit() else dims[term] for term in expression.split("+"))


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one leaf lives: its buffer, offsets and shape."""
    name: str
    spec: PackedField
    buffer: str
    start: int
    stop: int
    shape: tuple[int, ...]


class Packing:
    """The layout of a packed dataclass `cls` for concrete dimensions (T, S, ...): see the module docstring."""

    def __init__(self, cls: type, dims: dict[str, int]):
        self.cls = cls
        self.dims = dict(dims)
        self.sizes = {_INT: 0, _FLOAT: 0}
        self.tree = self._layout(cls)
        self._template: tuple[np.ndarray, np.ndarray] | None = None

    def _layout(self, cls: type) -> dict[str, Any]:
        hints = typing.get_type_hints(cls)
        tree = {}
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("packed")
            if spec is None:  # a nested packed dataclass
                tree[f.name] = (hints[f.name], self._layout(hints[f.name]))
                continue
            shape = tuple(_size(d, self.dims) for d in spec.shape)
            if not math.prod(shape):
                tree[f.name] = None
                continue
            buffer = _STORED[spec.dtype]
            start = self.sizes[buffer]
            self.sizes[buffer] += math.prod(shape)
            tree[f.name] = _Slot(f.name, spec, buffer, start, self.sizes[buffer], shape)
        return tree

    @property
    def int_size(self) -> int:
        return self.sizes[_INT]

    @property
    def float_size(self) -> int:
        return self.sizes[_FLOAT]

    def _build(self, tree: dict, cls: type, leaf: Callable[[_Slot], Any]):
        values = {}
        for name, node in tree.items():
            if node is None:
                values[name] = None
            else:
                values[name] = self._build(node[1], node[0], leaf) if isinstance(node, tuple) else leaf(node)
        return cls(**values)

    def _slots(self, tree: dict | None = None):
        for node in (tree or self.tree).values():
            if isinstance(node, tuple):
                yield from self._slots(node[1])
            elif node is not None:
                yield node

    def empty(self) -> tuple[np.ndarray, np.ndarray]:
        """Fresh buffers holding every field's fill value (a step with no sequences: all padding)."""
        if self._template is None:
            buffers = {_INT: np.zeros(self.int_size, np.int32), _FLOAT: np.zeros(self.float_size, np.float32)}
            for slot in self._slots():
                fill = slot.spec.fill
                if isinstance(fill, str):
                    fill = _size(fill, self.dims)
                if fill:
                    buffers[slot.buffer][slot.start:slot.stop] = fill
            self._template = buffers[_INT], buffers[_FLOAT]
        return self._template[0].copy(), self._template[1].copy()

    def views(self, ints: np.ndarray, floats: np.ndarray):
        """An instance of the dataclass whose leaves are writable numpy views into the two buffers."""
        buffers = {_INT: ints, _FLOAT: floats}

        def view(slot: _Slot) -> np.ndarray:
            flat = buffers[slot.buffer][slot.start:slot.stop]
            if slot.spec.dtype != flat.dtype:
                flat = flat.view(slot.spec.dtype)
            return flat.reshape(slot.shape)

        return self._build(self.tree, self.cls, view)

    def unpack(self, ints, floats):
        """Inside the jitted step: an instance whose leaves are static slices of the two (traced) buffers."""
        import jax

        buffers = {_INT: ints, _FLOAT: floats}

        def leaf(slot: _Slot):
            flat = buffers[slot.buffer][slot.start:slot.stop]
            if slot.spec.dtype != flat.dtype:
                flat = jax.lax.bitcast_convert_type(flat, slot.spec.dtype)
            return flat.reshape(slot.shape)

        return self._build(self.tree, self.cls, leaf)

    def sourced(self, group: str | None = None) -> list[tuple[tuple[str, ...], Callable]]:
        """(path of the leaf, getter) of every field with a per-sequence source, at the top level of the
        dataclass (group None) or inside its nested dataclass `group`."""
        tree = self.tree if group is None else self.tree[group][1]
        prefix = () if group is None else (group,)
        return [(prefix + (name,), node.spec.source) for name, node in tree.items()
                if isinstance(node, _Slot) and node.spec.source is not None]


def leaf_at(instance, path: tuple[str, ...]):
    for name in path:
        instance = getattr(instance, name)
    return instance
