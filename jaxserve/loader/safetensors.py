"""Safetensors checkpoints read by parameter path, as whole tensors or as any device's slice.

1. Map each parameter path to its Hugging Face tensor name (`model.layers.0.self_attn.q_proj.weight`),
   find the file that holds it (single file or `model.safetensors.index.json`) and hand out a filler for
   any region of it. Files are memory-mapped and read in place: a region is copied once, straight into
   the buffer that becomes the device array (transposed on the way for linear kernels, which HF stores
   [out, in], in cache-sized tiles; converted to the model's dtype in the same pass). After each tensor
   the mapping's pages are dropped from this process (the page cache keeps them), so the checkpoint is
   never resident twice. `RegionReader.read` (`placement.py`) asks each device's slice.
2. A checkpoint that `jaxserve convert --format mapped` wrote (`mapped.py`) is already in the model's
   layout and dtype, named by parameter path, with every tensor 64-byte aligned: its tensors are used
   where they lie in the mapping (`SafetensorsReader.in_place`), as llama.cpp uses a GGUF file. On CPU the
   mapped pages become the device arrays, with no copy; elsewhere they are copied to the device without
   a transpose. Missing tensors and shape mismatches are errors that name the tensor.
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.json_files import read_json_object
from jaxserve.loader.placement import RegionReader
from sharding.loading import HOST_ALIGNMENT, InPlace

logger = logging.getLogger(__name__)

def hf_tensor_name(path: tuple) -> tuple[str, bool]:
    """NNX parameter path -> (Hugging Face tensor name, whether to transpose)."""
    *module_path, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    name = ".".join(module_path + [leaf])
    return (name if name.startswith("lm_head") else f"model.{name}"), transpose


def expert_tensor_names(path: tuple, num_experts: int) -> list[str] | None:
    """A stacked expert parameter (`layers/0/mlp/experts/gate_proj`, [E, in, out]) -> the Hugging Face
    names of its experts' tensors, one per expert ([out, in] each); None for any other parameter."""
    *module_path, parent, leaf = (str(p) for p in path)
    if parent != "experts" or leaf in ("kernel", "bias"):
        return None
    prefix = ".".join(["model", *module_path, "experts"])
    return [f"{prefix}.{e}.{leaf}.weight" for e in range(num_experts)]


# Where a multimodal checkpoint keeps its language model (transformers 5, then 4): served under these
# names, while the vision tower and projector are skipped by name, never loaded.
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
SKIPPED_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
                    "visual.", "model.visual.")


def language_model_names(stored: list[str]) -> dict[str, str]:
    """{name a text-only checkpoint gives a tensor (`model.*`, `lm_head.*`): its name in this checkpoint}
    for a multimodal checkpoint's language model; empty for a text-only checkpoint."""
    if "model.embed_tokens.weight" in stored:
        return {}
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if prefix + "embed_tokens.weight" not in stored:
            continue
        aliases = {}
        for name in stored:
            if name.startswith(prefix):
                aliases["model." + name[len(prefix):]] = name
            elif name in ("lm_head.weight", "language_model.lm_head.weight"):
                aliases["lm_head.weight"] = name
            elif not name.startswith(SKIPPED_PREFIXES):
                raise ValueError(f"tensor {name!r} belongs neither to the language model nor to a vision part "
                                 f"that jaxserve skips ({', '.join(SKIPPED_PREFIXES)})")
        return aliases
    return {}


def param_tensor_name(path: tuple) -> str:
    """NNX parameter path -> its tensor's name in a checkpoint in the model's own layout."""
    return ".".join(str(p) for p in path)


def safetensors_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index of a sharded checkpoint or the single file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no \"weight_map\" object naming each tensor's file (download it again)")
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    return {name: single for name in read_header(single)[1]}


# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec) -> numpy dtypes
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
SAFETENSORS_CODES = {np.dtype(t): code for code, t in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the format's own limit on the JSON header
# Linux 5.14's madvise(MADV_POPULATE_READ): map a file region's pages now (Python 3.12 lacks the name).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data, {tensor name: {dtype, shape, data_offsets}}) of a .safetensors file.
    Layout: 8-byte little-endian header size, a JSON header, then the data. A file cut short (an interrupted
    download or copy) is refused here, naming it, before any tensor is read from it."""
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        if not 0 < header_size <= min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path} is truncated or not a safetensors file: its first 8 bytes announce a "
                             f"{header_size}-byte header in a {file_size}-byte file (download it again)")
        try:
            header = json.loads(f.read(header_size))
            tensors = {name: info for name, info in header.items() if name != "__metadata__"}
            data_end = max((info["data_offsets"][1] for info in tensors.values()), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ValueError(f"{path} is corrupt: its safetensors header is broken ({e}); download it again") from None
    data_size = file_size - 8 - header_size
    if data_end > data_size:
        raise ValueError(f"{path} is truncated: its header describes {data_end} bytes of tensor data but the file "
                         f"holds {data_size} (an interrupted download or copy? download it again)")
    return 8 + header_size, tensors


class SafetensorsFile:
    """One .safetensors file, memory-mapped read-only; each tensor a zero-copy numpy view of the mapping.

    The `safetensors` package hands out copies only; reading in place lets a region go straight into its
    destination buffer (one copy instead of two or three) and lets `release` drop the mapped pages.
    """

    def __init__(self, path: Path):
        self.path = path
        self._data_start, self.tensors = read_header(path)
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        probe = np.frombuffer(self._map, np.uint8, 1)
        self._address = probe.ctypes.data  # where the mapping starts, for madvise offsets of views
        del probe

    def view(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(SAFETENSORS_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        count = (end - begin) // dtype.itemsize
        return np.frombuffer(self._map, dtype, count, self._data_start + begin).reshape(info["shape"])

    def release(self, name: str) -> None:
        """Drop the tensor's mapped pages from this process's resident memory (the page cache keeps them)."""
        begin, end = self.tensors[name]["data_offsets"]
        first = (self._data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, first, self._data_start + end - first)

    def populate(self, view: np.ndarray) -> None:
        """Map a view's pages into this process now, from the page cache: loading pays for it, not the
        first request that touches the weights."""
        offset = view.ctypes.data - self._address
        first = offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(MADV_POPULATE_READ, first, offset + view.nbytes - first)
        except OSError:  # a kernel before 5.14: read ahead instead
            self._map.madvise(mmap.MADV_WILLNEED, first, offset + view.nbytes - first)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping goes when the view does
            pass


def copy_transposed(out: np.ndarray, source: np.ndarray) -> None:
    """out[...] = source.T (2-D), converting dtype on the way, a band of source rows at a time.

    Each band writes one 64-byte cache line of every output row (16 float32 or 32 bfloat16 columns), so
    the output is written in whole lines while the band's rows stay in cache: 4.2 GB/s on one core
    against 0.6 GB/s for a plain `out[...] = source.T`. numpy drops the GIL for each band's copy, so
    several loader threads transpose at once.
    """
    band = max(1, 64 // out.dtype.itemsize)
    for i in range(0, source.shape[0], band):
        np.copyto(out[:, i:i + band], source[i:i + band].T, casting="unsafe")


class SafetensorsReader(RegionReader):
    """Regions of checkpoint tensors by NNX parameter path, from the memory-mapped files: Hugging Face
    tensors (copied, kernels transposed) or, with `own_layout`, a checkpoint in the model's own layout
    (`jaxserve convert --format mapped`), whose tensors `in_place` hands out where they lie. `files`: each
    tensor's file, where the caller has read them already (`formats.Checkpoint`)."""

    def __init__(self, model_dir: str | Path, own_layout: bool = False, files: dict[str, Path] | None = None):
        self.model_dir = Path(model_dir)
        self.own_layout = own_layout
        self.files = safetensors_files(self.model_dir) if files is None else files
        self.aliases = {} if own_layout else language_model_names(list(self.files))
        skipped = 0 if own_layout else sum(1 for name in self.files if name.startswith(SKIPPED_PREFIXES))
        if skipped:  # a multimodal checkpoint (Qwen-VL's hub files name the language model as a text model's)
            logger.info("%s: serving the language model; %d vision tensors skipped", self.model_dir, skipped)
        self._open: dict[Path, SafetensorsFile] = {}
        self._opening = threading.Lock()  # loader threads ask for tensors of the same file at once
        self.in_place_bytes = 0  # served where they lie in the mapping (for the log)

    @property
    def description(self) -> str:
        """Where the weights came from (after a read: how much was used in place)."""
        if self.own_layout:
            return f"{self.model_dir} (mapped safetensors, {self.in_place_bytes / 1e6:.1f} MB in place)"
        return f"{self.model_dir} (safetensors)"

    def _file(self, path: tuple) -> tuple[str, bool, SafetensorsFile]:
        name, transpose = (param_tensor_name(path), False) if self.own_layout else hf_tensor_name(path)
        return self._named(name, transpose)

    def _named(self, name: str, transpose: bool) -> tuple[str, bool, SafetensorsFile]:
        name = self.aliases.get(name, name)
        if name not in self.files and name.startswith("model.") and name[len("model."):] in self.files:
            # The bare decoder's checkpoint (`AutoModel`, as sentence-transformers saves embedding models)
            # names its tensors without the causal-LM wrapper's `model.` prefix.
            name = name[len("model."):]
        return name, transpose, self._file_of(name)

    def tensor(self, name: str) -> np.ndarray:
        """A whole tensor by its checkpoint name, as stored (a read-only view of the mapping): what the
        quantized-checkpoint formats' `read_linear` reads. KeyError when the checkpoint lacks it."""
        if name not in self.files:
            raise KeyError(name)
        return self._file_of(name).view(name)

    def _file_of(self, name: str) -> SafetensorsFile:
        if name not in self.files:
            raise ValueError(f"checkpoint {self.model_dir} is missing tensor {name!r}")
        file = self.files[name]
        with self._opening:
            if file not in self._open:
                self._open[file] = SafetensorsFile(file)
        if name not in self._open[file].tensors:
            raise ValueError(f"{file} does not hold tensor {name!r} (its index says it does)")
        return self._open[file]

    def reader(self, path: tuple, shape: tuple[int, ...]):
        """A function (index, out) that fills `out` with the region `index` of the parameter at `path`
        (NNX layout: [in, out] kernels), in out's dtype."""
        experts = None if self.own_layout or not shape else expert_tensor_names(path, shape[0])
        if experts is not None:
            return self._expert_stack(experts, shape)
        return self._tensor_reader(*self._file(path), shape)

    def _expert_stack(self, names: list[str], shape: tuple[int, ...]):
        """Stacks the experts' [out, in] tensors into [E, in, out] regions as they are read."""
        fills = [self._tensor_reader(*self._named(name, True), shape[1:]) for name in names]

        def fill(index: tuple[slice, ...], out: np.ndarray) -> None:
            index = index or tuple(slice(None) for _ in shape)
            for row, expert in enumerate(range(shape[0])[index[0]]):
                fills[expert](index[1:], out[row])

        return fill

    def _tensor_reader(self, name: str, transpose: bool, file: SafetensorsFile, shape: tuple[int, ...]):
        stored = tuple(file.tensors[name]["shape"])
        expected = tuple(shape[::-1]) if transpose else tuple(shape)  # as the checkpoint would store it
        if stored != expected:
            raise ValueError(f"weight {name!r} in {file.path} has shape {stored} but {self.model_dir / 'config.json'} "
                             f"implies {expected} (is config.json from another model?)")

        def fill(index: tuple[slice, ...], out: np.ndarray) -> None:
            view = file.view(name)
            if transpose:  # HF stores linear weights [out, in]
                copy_transposed(out, view[index[1], index[0]])
            else:
                np.copyto(out, view[index] if index else view, casting="unsafe")
            del view
            file.release(name)

        return fill

    def in_place(self, path: tuple, dtype) -> InPlace | None:
        """Regions of the parameter at `path` as read-only views of the mapping, for a checkpoint in the
        model's own layout stored in `dtype`; None where a region needs a copy (see `array_from_reader`)."""
        if not self.own_layout:
            return None
        name, _, file = self._file(path)
        if np.dtype(SAFETENSORS_DTYPES.get(file.tensors[name]["dtype"], np.void)) != np.dtype(dtype):
            return None

        def region(index: tuple[slice, ...]) -> np.ndarray | None:
            view = file.view(name)[index]
            if not view.flags.c_contiguous or view.ctypes.data % HOST_ALIGNMENT:
                return None  # e.g. a column slice for tensor parallelism: copied instead
            file.populate(view)
            with self._opening:
                self.in_place_bytes += view.nbytes
            return view

        return region

    def close(self) -> None:
        for file in self._open.values():
            file.close()  # a mapping whose views became device arrays stays until they go
        self._open.clear()
