"""Devices to compile for, without the chips: TPU and NVIDIA GPU programs built here by the real compilers.

1. The compilers are the ones the chips use: libtpu's compile-only client for TPUs, and for NVIDIA GPUs
   JAX's CUDA plugin with ptxas and libdevice (no driver, no GPU). `compiler_requirements()` names the
   versions that pair with the installed jaxlib; `install_compilers()` puts them in a folder of their own
   (`compilers_dir()`: `$JAXSERVE_COMPILERS`, else a per-jaxlib folder in the user's cache), never in the
   serving environment, so a CPU, GPU or TPU install carries no other platform's packages or warnings.
2. `compile_devices(target)` makes them importable (the folder goes on `sys.path` only then, after JAX
   has started its own backends), quiets libtpu's probing for a TPU that is not there, and returns the
   target's devices: `jax.jit(f).lower(ShapeDtypeStructs on a mesh of them).compile()` then compiles for
   that slice, Mosaic's and Triton's own checks included (lowering alone skips them).
3. A GPU is described to XLA by a text proto of its figures (SM count, shared memory, compute capability).
   The CUDA plugin carries XLA's descriptions of the chips it knows; `gpu_target_config` reads the one
   named in `sharding/chips.py` from the plugin's library.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

from sharding.chips import Target

COMPILERS_ENV = "JAXSERVE_COMPILERS"
_COMPLETE = ".complete"  # written last by install_compilers: a folder without it is a broken install
CUDA_PLUGIN = "jax_plugins.xla_cuda13"  # the CUDA 13 plugin, as the `cuda` extra installs for serving


class CompilersMissing(ImportError):
    """The compiler for a target is not installed; the message says how to install it."""


def compilers_dir() -> Path:
    """Where the compile-only packages live: $JAXSERVE_COMPILERS, else the user's cache, per jaxlib version
    (the compilers must pair with the jaxlib that drives them)."""
    if os.environ.get(COMPILERS_ENV):
        return Path(os.environ[COMPILERS_ENV])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "jaxserve" / f"compilers-jaxlib-{importlib.metadata.version('jaxlib')}"


def compiler_requirements() -> list[str]:
    """pip requirements of the compile-only packages for the installed jaxlib: libtpu as jax's `tpu`
    extra pins it, the CUDA 13 plugin of the same version, ptxas (nvcc) and libdevice (nvvm)."""
    jaxlib = importlib.metadata.version("jaxlib")
    libtpu = next((r.split(";")[0].strip() for r in importlib.metadata.requires("jax") or []
                   if r.startswith("libtpu") and 'extra == "tpu"' in r), "libtpu")
    return [libtpu, f"jax-cuda13-plugin=={jaxlib}", f"jax-cuda13-pjrt=={jaxlib}", "nvidia-cuda-nvcc==13.*",
            "nvidia-nvvm==13.*"]


def install_command(directory: Path | None = None) -> list[str]:
    directory = directory or compilers_dir()
    return [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
            str(directory), *compiler_requirements()]


def install_compilers(directory: Path | None = None) -> Path:
    """pip-install the compile-only packages into `directory` (default `compilers_dir()`); idempotent."""
    directory = directory or compilers_dir()
    marker = directory / _COMPLETE
    wanted = "\n".join(compiler_requirements())
    if marker.exists() and marker.read_text() == wanted:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(install_command(directory), check=True)
    marker.write_text(wanted)
    return directory


def _missing(platform: str) -> CompilersMissing:
    command = " ".join(install_command())
    return CompilersMissing(f"no {platform.upper()} compiler here: install the compile-only packages with "
                            f"`jaxserve plan --install-compilers` (runs `{command}`; about 1.1 GB, outside "
                            f"this environment; set ${COMPILERS_ENV} to put them elsewhere)")


def _use_compilers_dir(platform: str) -> None:
    """Put the compilers' folder on sys.path; JAX's own backends start first, so a CPU process does not
    pick up the plugins as devices of its own."""
    jax.devices()
    directory = compilers_dir()
    if not (directory / _COMPLETE).exists():
        raise _missing(platform)
    if str(directory) not in sys.path:
        sys.path.append(str(directory))
        importlib.invalidate_caches()


@functools.cache
def _tpu_ready() -> None:
    try:
        libtpu = importlib.import_module("libtpu")  # a TPU VM's own install, or ours already on sys.path
    except ImportError:
        _use_compilers_dir("tpu")
        libtpu = importlib.import_module("libtpu")
    if Path(libtpu.__file__).is_relative_to(compilers_dir()):
        # Ours, so no TPU here: keep libtpu from asking a metadata server and probing for chips, and let
        # several processes (test workers) load it at once (it locks a file for the chips it would own).
        for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v6e-1"),
                            ("TPU_WORKER_HOSTNAMES", "localhost"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
            os.environ.setdefault(name, value)


@functools.cache
def _cuda_ready() -> None:
    from jax._src import xla_bridge
    if "cuda" in xla_bridge._topology_factories:  # the environment's plugin was discovered at start
        return
    try:
        plugin = importlib.import_module(CUDA_PLUGIN)
    except ImportError:
        _use_compilers_dir("gpu")
        plugin = importlib.import_module(CUDA_PLUGIN)
        # Ours holds the compiler alone: the runtime libraries the plugin checks for (cuDNN, cuBLAS...) run
        # kernels, and nothing here runs.
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        plugin.initialize()
    except jax.errors.JaxRuntimeError as e:  # registered by JAX's own discovery meanwhile
        if "ALREADY_EXISTS" not in str(e):
            raise


@functools.cache
def gpu_target_config(description: str) -> str:
    """XLA's description of the GPU named `description` (a GpuTargetConfigProto in text form), read from the
    CUDA plugin's library, where XLA keeps one per chip it knows."""
    _cuda_ready()
    plugin = importlib.import_module(CUDA_PLUGIN)
    library = Path(plugin.__file__).parent / "xla_cuda_plugin.so"
    data = library.read_bytes()
    found = re.search(rb'device_description_str: "' + re.escape(description.encode()) + rb'"\n', data)
    if found is None:
        known = sorted({m.decode() for m in re.findall(rb'device_description_str: "([^"]+)"', data)})
        raise ValueError(f"XLA's CUDA plugin has no description of {description!r}; it knows {known}")
    # Each description is one NUL-terminated string in the library's data.
    return data[data.rindex(b"\0", 0, found.start()) + 1:data.index(b"\0", found.start())].decode()


@functools.cache
def _topology_devices(target: Target) -> tuple:
    from jax.experimental import topologies
    if target.chip.is_tpu:
        _tpu_ready()
        options = {}
        if target.chip.name == "v4":
            options["chip_config_name"] = "megacore"  # one device a chip, as JAX runs a v4
        if target.hosts == 1 and target.chips > 4:  # v5e-8 / v6e-8: one host of 8 chips, as Cloud TPU has it
            options["chips_per_host_bounds"] = (2, 4, 1)
        topology = topologies.get_topology_desc(topology_name=target.topology, platform="tpu", **options)
    else:
        config = gpu_target_config(target.chip.description)
        topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology=target.topology)
    return tuple(topology.devices)


def compile_options(target: Target) -> dict:
    """XLA options a compile without the chip needs. On a GPU, XLA sizes the scratch of CUB's radix sort (its
    choice for a large top-k, such as prompt logprobs over a whole vocabulary) by asking the device: without
    one it fails ("invalid device ordinal"), so those sorts compile to XLA's own here. The programs differ
    from a GPU's own only in that sort and its scratch bytes."""
    return {} if target.chip.is_tpu else {"xla_gpu_enable_cub_radix_sort": False}


def compile_devices(target: Target) -> list:
    """The target's devices, compile-only: a mesh of them compiles for that slice. Compile under
    `with jax.default_device(devices[0])`: Pallas' GPU lowering looks for a GPU there."""
    devices = list(_topology_devices(target))
    if len(devices) != target.chips:
        raise RuntimeError(f"{target.topology} gave {len(devices)} devices, expected {target.chips}")
    return devices
