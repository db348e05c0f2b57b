"""Compiled step programs kept on disk, found on a restart without tracing the step again.

JAX's persistent compilation cache is keyed by the lowered program, so finding a program in it still
costs tracing and lowering the step: for a 16-layer 1B Llama on a CPU that is most of a restart's first
program (the layers, the sampler and the attention traced in Python, then lowered to MLIR). This cache is
keyed by what the program is made from instead, so a hit is one file read and `deserialize_and_load`:

- the environment: Python, jax, jaxlib, flax, numpy and ml_dtypes versions, the backend and its devices,
  `XLA_FLAGS`, and every JAX option that can change a program (the cache options and logging left out);
- the code: a hash of every source file of the packages whose code the step runs (`jaxserve`,
  `pallas_kernels`, `sharding`), so any edit misses rather than loading a stale program;
- the program: the shapes, dtypes, shardings and tree structure of its arguments and everything the step
  closes over (model graph and config, attention backend, pipeline stages, sampler sizes, batch layout).

Entries live in `<JAX compilation cache dir>/jaxserve-programs/<environment and code hash>/`; the cache
is off when JAX's is. Only the most recently used few code versions are kept. A missing, unreadable or
stale-by-accident entry falls back to compiling (through JAX's cache), and is rewritten.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import jax
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

FORMAT = 2  # bump when the entry layout changes (2: entries re-serialized from JAX's cache were broken)
CODE_VERSIONS_KEPT = 4
_PACKAGES = ("jaxserve", "pallas_kernels", "sharding")
_NOT_PROGRAM_OPTIONS = re.compile(r"compilation_cache|persistent_cache|log|explain_cache_misses")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def describe(value) -> str:
    """A text that is the same in every process for equal values: reprs without object addresses
    (a function's repr names it by module and name; the code behind it is in the code hash)."""
    return _ADDRESS.sub("", repr(value))


def source_hash(root: Path, packages=_PACKAGES) -> str:
    """A hash of every Python source file (path and bytes) of `packages` under `root`."""
    code = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            code.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return code.hexdigest()


@functools.cache
def _own_source_hash() -> str:
    return source_hash(Path(__file__).resolve().parents[2])


def environment_fingerprint() -> str:
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    options = {k: v for k, v in sorted(jax.config.values.items()) if not _NOT_PROGRAM_OPTIONS.search(k)}
    parts = (FORMAT, sys.version, [version(p) for p in ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")],
             jax.default_backend(), jax.devices()[0].client.platform_version, devices,
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), options,
             _own_source_hash())
    return hashlib.sha256(describe(parts).encode()).hexdigest()[:24]


class ProgramCache:
    def __init__(self, directory: str | os.PathLike | None):
        self.directory = Path(directory) / environment_fingerprint() if directory else None

    @classmethod
    def beside_jax_cache(cls) -> ProgramCache:
        """In JAX's persistent cache directory when one is set (the server sets it); off otherwise."""
        jax_dir = jax.config.jax_compilation_cache_dir
        return cls(Path(jax_dir) / "jaxserve-programs" if jax_dir else None)

    @staticmethod
    def key(*program_parts) -> str:
        return hashlib.sha256(describe(program_parts).encode()).hexdigest()

    def load(self, key: str, devices):
        """The compiled program stored under `key`, loaded onto `devices` (the program's device assignment:
        its mesh's devices in mesh order; the key must name them too), or None."""
        path = self._path(key)
        if path is None or not path.is_file():
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                 execution_devices=list(devices))
        except Exception as e:  # a torn or foreign file: compile instead, and overwrite it
            logger.warning("program cache entry %s unusable (%s: %s); compiling", path.name, type(e).__name__, e)
            return None
        os.utime(path.parent)  # recently used: kept when old code versions are dropped
        return compiled

    def store(self, key: str, compiled) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: a reader (another server starting) never sees half a file.
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
                out.write(payload)
            os.replace(out.name, path)
            self._drop_old_versions()
        except Exception as e:  # serving does not depend on the cache
            logger.warning("program cache: could not store %s (%s: %s)", path.name, type(e).__name__, e)

    def _path(self, key: str) -> Path | None:
        return self.directory / f"{key}.program" if self.directory is not None else None

    def _drop_old_versions(self) -> None:
        versions = sorted((p for p in self.directory.parent.iterdir() if p.is_dir()),
                          key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in versions[CODE_VERSIONS_KEPT:]:
            if stale != self.directory:
                shutil.rmtree(stale, ignore_errors=True)
