"""The mapped format, for fast starts: safetensors files in the model's own layout and dtype (linear
kernels [in, out], named by parameter path), every tensor 64-byte aligned, so that the loader uses each
tensor where it lies in the memory-mapped file (`safetensors.py`), as llama.cpp does with a GGUF file.
Quantized linear layers are stored as they run (codes, scales, zeros); int4 codes, which safetensors has
no type for, one per byte (I8 / U8), converted as they are read.

Each file is a valid safetensors file: the header is padded with spaces to a multiple of 64 bytes, and a
tensor whose size is not a multiple of 64 is followed by a small padding tensor (`__pad__.N`), so that
every tensor's data starts 64-byte aligned. Tensors are written one at a time (one in memory at most).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np

from jaxserve.loader.dtypes import stored_dtype
from jaxserve.loader.placement import RegionReader, loading_progress
from jaxserve.loader.safetensors import SAFETENSORS_CODES, param_tensor_name
from sharding.loading import HOST_ALIGNMENT, host_buffer

MAPPED_SHARD_BYTES = 4 << 30  # tensors per file, at most (one tensor bigger than this gets a file alone)


def write_mapped(reader: RegionReader, params: list[tuple[tuple, jax.ShapeDtypeStruct]], output: Path) -> int:
    """Write every parameter of `params` ((path, shape and dtype), `AbstractModel.params`), as `reader` fills
    it, into `output` in the mapped format; returns the number of tensors. The reader is closed afterwards."""
    shards: list[list] = [[]]
    filled = 0  # bytes in the last shard
    for path, spec in params:
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        stored = stored_dtype(dtype)
        size = math.prod(shape) * stored.itemsize
        if shards[-1] and filled + size > MAPPED_SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append((path, shape, dtype, stored, size))
        filled += size
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    reader.expect({path: tuple(spec.shape) for path, spec in params})
    try:
        with loading_progress(len(params)) as bar:
            for name, shard in zip(names, shards):
                header, offset, pad = {"__metadata__": {"format": "jaxserve", "layout": "nnx"}}, 0, 0
                for path, shape, _, stored, size in shard:
                    header[param_tensor_name(path)] = {"dtype": SAFETENSORS_CODES[stored], "shape": list(shape),
                                                       "data_offsets": [offset, offset + size]}
                    weight_map[param_tensor_name(path)] = name
                    offset += size
                    if offset % HOST_ALIGNMENT:
                        gap = HOST_ALIGNMENT - offset % HOST_ALIGNMENT
                        header[f"__pad__.{pad}"] = {"dtype": "U8", "shape": [gap],
                                                    "data_offsets": [offset, offset + gap]}
                        offset, pad = offset + gap, pad + 1
                encoded = json.dumps(header).encode()
                encoded += b" " * (-(8 + len(encoded)) % HOST_ALIGNMENT)
                with open(output / name, "wb") as f:
                    f.write(len(encoded).to_bytes(8, "little") + encoded)
                    for path, shape, dtype, stored, _ in shard:
                        data = host_buffer(shape, dtype)
                        reader.reader(path, shape)(tuple(slice(None) for _ in shape), data)
                        f.write(memoryview(data.astype(stored, copy=False).reshape(-1).view(np.uint8)))
                        if f.tell() % HOST_ALIGNMENT:
                            f.write(b"\0" * (HOST_ALIGNMENT - f.tell() % HOST_ALIGNMENT))
                        bar.update()
    finally:
        reader.close()
    if len(shards) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    return len(params)
