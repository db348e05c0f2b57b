"""Sharded loading helpers: build device arrays one shard at a time, then re-label them without copying.

1. `array_from_reader` fills one parameter on its sharding: for each device this process addresses it
   asks the reader to fill an aligned host buffer with exactly that device's slice of the checkpoint
   tensor (zero-padded past the tensor's end when the layout pads) and puts it on the device: on CPU
   the buffer becomes the device array, elsewhere it is copied over and dropped. Devices that hold
   the same slice (replicas) share one read. Host memory in flight is one shard, never the tensor, let
   alone the model.
2. A layer's parameters are built on its pipeline stage's devices only (a sub-mesh). `stack_stages`
   then declares the stages' arrays for one layer slot to be the shards of a single array over the
   whole mesh, stacked along dim 0 and split over the pipeline axis: the same device buffers, no copy.
   Padding slots (past the last layer) get zero shards.
"""

from __future__ import annotations

import functools
import mmap
from typing import Callable, Sequence

import jax
import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so checkpoint slices can be bf16
import numpy as np
from jax.sharding import NamedSharding

from sharding.mesh import MeshPlan

# fill(index, out): write the checkpoint tensor's region at `index` (slices clipped to the tensor's shape)
# into `out`, converting to out's dtype
Fill = Callable[[tuple[slice, ...], np.ndarray], None]

# in_place(index): the region at `index` as a read-only array that can become the device array as it is
# (the right dtype, C-contiguous, aligned: a memory-mapped checkpoint in the model's own layout), or None
InPlace = Callable[[tuple[slice, ...]], "np.ndarray | None"]

# XLA:CPU adopts a host buffer aligned to this many bytes as the device array without copying it.
HOST_ALIGNMENT = 64
# Host buffers from this size up are mapped in small pages (see host_buffer).
SMALL_PAGES_FROM = 4 << 20


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised, 64-byte-aligned numpy array. On CPU `jax.device_put` keeps it as the device
    buffer (no second copy, no second page-faulting pass over fresh memory); elsewhere it is copied to
    the device and freed.

    Large buffers are anonymous mappings in small (4 KiB) pages. numpy asks for transparent huge pages
    for every array over 4 MiB, and on a VM whose host backs guest memory lazily (the development
    machine: Firecracker with free page reporting) fresh huge pages fault in slowly: the serving loader
    read a 1.1B float32 model at 1.1-2.0 GB/s into small pages against 0.35-1.55 GB/s into huge ones,
    and at 0.52-0.62 against 0.39-0.54 once the host had taken freed memory back. Weights stream through
    the matmuls in order, so the TLB gains little from huge pages: batch-1 decode in small pages read
    0.986x of huge pages over six paired runs (within the machine's scatter), and llama.cpp computes from
    small page-cache pages too. Mappings are page aligned. See docs/performance.md, cold start."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= SMALL_PAGES_FROM and hasattr(mmap, "MADV_NOHUGEPAGE"):
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
        # The array keeps the mapping alive (and so does a device array adopted from it); unmapped with it.
        return np.frombuffer(mapping, np.uint8).view(dtype).reshape(shape)
    raw = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % HOST_ALIGNMENT
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def _normalise(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def read_padded(fill: Fill, bounds: tuple[tuple[int, int], ...], shape: tuple[int, ...], dtype) -> np.ndarray:
    """The region `bounds` of a tensor of logical `shape`; the part past its end is zeros."""
    clipped = tuple((min(a, n), min(b, n)) for (a, b), n in zip(bounds, shape))
    want = tuple(b - a for a, b in bounds)
    have = tuple(b - a for a, b in clipped)
    data = host_buffer(want, dtype)
    if have != want:
        data[...] = 0
    if all(h > 0 for h in have):
        fill(tuple(slice(a, b) for a, b in clipped), data[tuple(slice(0, h) for h in have)])
    return data


def array_from_reader(shape: tuple[int, ...], padded: tuple[int, ...], sharding: NamedSharding, dtype,
                      fill: Fill, in_place: InPlace | None = None) -> jax.Array:
    """A `padded`-shape array on `sharding`, filled device by device from a tensor of shape `shape`.
    A region `in_place` offers (no padding in it) goes to its device as it is: on CPU the mapped file's
    pages become the device array, with no copy at all."""
    index_map = sharding.addressable_devices_indices_map(padded)
    by_bounds = sorted(((_normalise(index, padded), device) for device, index in index_map.items()),
                       key=lambda item: (item[0], item[1].id))
    shards, last, host = [], None, None
    for bounds, device in by_bounds:
        if bounds != last:
            last, host = bounds, None
            if in_place is not None and all(b <= n for (_, b), n in zip(bounds, shape)):
                host = in_place(tuple(slice(a, b) for a, b in bounds))
            if host is None:
                host = read_padded(fill, bounds, shape, dtype)
        shards.append(jax.device_put(host, device))
    del host
    # dtype: on a multi-host mesh this process may hold no shard of a stage that lives elsewhere.
    return jax.make_array_from_single_device_arrays(padded, sharding, shards, dtype=np.dtype(dtype))


def stack_stages(pieces: Sequence[jax.Array | None], plan: MeshPlan, spec) -> jax.Array:
    """Per-stage arrays of one layer slot (None = padding) -> one array [pp * d0, ...] on the whole mesh.

    `pieces[s]` lives on stage s's sub-mesh; `spec` is the runtime PartitionSpec (pipeline first on dim 0).
    Pieces may be `jax.ShapeDtypeStruct`s (an abstract model): the answer is then one too.
    """
    template = next(p for p in pieces if p is not None)
    shape = (plan.pp * template.shape[0],) + tuple(template.shape[1:])
    sharding = NamedSharding(plan.mesh, spec)
    if isinstance(template, jax.ShapeDtypeStruct):  # an abstract model (compile-only): shapes, no buffers
        return jax.ShapeDtypeStruct(shape, template.dtype, sharding=sharding)
    shard_shape = sharding.shard_shape(shape)
    local = {d.id for d in jax.local_devices()}
    shards = []
    for stage, piece in enumerate(pieces):
        if piece is not None:
            shards.extend(s.data for s in piece.addressable_shards)
            continue
        for device in plan.mesh.devices[stage].flat:
            if device.id in local:
                shards.append(jax.device_put(np.zeros(shard_shape, template.dtype), device))
    return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=template.dtype)


def zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding) -> jax.Array:
    """A zero array created directly in its shards (never whole on one device or host)."""
    return _zeros_program(tuple(shape), np.dtype(dtype), sharding)()


@functools.cache
def _zeros_program(shape: tuple[int, ...], dtype: np.dtype, sharding: NamedSharding):
    # One program per shape: the KV cache asks for the same shape twice per layer, and a fresh jit each
    # time compiled it again (34 compilations, 0.9 s of a 1B model's start).
    return jax.jit(functools.partial(jax.numpy.zeros, shape, dtype), out_shardings=sharding)
