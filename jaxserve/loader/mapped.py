"""The mapped format, for fast starts: safetensors files in the model's own layout and dtype (linear
kernels [in, out], named by parameter path), every tensor 64-byte aligned, so that the loader uses each
tensor where it lies in the memory-mapped file (`safetensors.py`), as llama.cpp does with a GGUF file.

Each file is a valid safetensors file: the header is padded with spaces to a multiple of 64 bytes, and a
tensor whose size is not a multiple of 64 is followed by a small padding tensor (`__pad__.N`), so that
every tensor's data starts 64-byte aligned. Tensors are written one at a time (one in memory at most).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.placement import loading_progress, param_specs
from jaxserve.loader.safetensors import SAFETENSORS_CODES, SafetensorsReader, param_tensor_name
from sharding.loading import HOST_ALIGNMENT, host_buffer

MAPPED_SHARD_BYTES = 4 << 30  # tensors per file, at most (one tensor bigger than this gets a file alone)


def write_mapped(model_dir: str | Path, output: Path, dtype) -> int:
    """Write the mapped format of a Hugging Face directory into `output`; returns the number of tensors."""
    params = [(path, tuple(spec.shape)) for path, spec in param_specs(ModelConfig.from_pretrained(model_dir), dtype)]
    dtype = np.dtype(dtype)
    shards: list[list] = [[]]
    filled = 0  # bytes in the last shard
    for path, shape in params:
        size = math.prod(shape) * dtype.itemsize
        if shards[-1] and filled + size > MAPPED_SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append((path, shape, size))
        filled += size
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    reader, weight_map = SafetensorsReader(model_dir), {}
    try:
        with loading_progress(len(params)) as bar:
            for name, shard in zip(names, shards):
                header, offset, pad = {"__metadata__": {"format": "jaxserve", "layout": "nnx"}}, 0, 0
                for path, shape, size in shard:
                    header[param_tensor_name(path)] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
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
                    for path, shape, _ in shard:
                        data = host_buffer(shape, dtype)
                        reader.reader(path, shape)(tuple(slice(None) for _ in shape), data)
                        f.write(memoryview(data.reshape(-1).view(np.uint8)))
                        if f.tell() % HOST_ALIGNMENT:
                            f.write(b"\0" * (HOST_ALIGNMENT - f.tell() % HOST_ALIGNMENT))
                        bar.update()
    finally:
        reader.close()
    if len(shards) > 1:
        (output / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=1))
    return len(params)
