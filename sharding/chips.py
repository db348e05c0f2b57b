"""The accelerators jaxserve serves on, and the names a user gives a slice of them.

1. `CHIPS` holds, per chip, the figures that bound a serving step, from the vendors' spec sheets: HBM per
   chip (as the device reports it: what an allocator can hand out) and its bandwidth, peak dense bf16
   FLOP/s and int8 OP/s (no sparsity), whether the chip computes in fp8, and how its slices are laid out.
2. `parse_target` reads the names users already type: Cloud TPU accelerator types (`v5e-16`, `v6e-8`,
   `v5p-8`, `v4-8`: the number counts chips on v5e and v6e, TensorCores, two a chip, on v4 and v5p) and
   GPU counts (`h100`, `h100x8`, `b200x16`: 8 to a host). A `Target` says how many chips, on how many
   hosts, and the topology name the compiler takes for it (`sharding/compile_only.py` builds its devices).
"""

from __future__ import annotations

import dataclasses
import re

GB = 10**9
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # "v6e", "h100"
    platform: str  # "tpu" or "gpu", as jax.default_backend() names it
    hbm_bytes: int  # per chip
    hbm_bandwidth: float  # bytes / s per chip
    bf16_flops: float  # dense peak FLOP/s per chip
    int8_ops: float  # dense peak int8 OP/s per chip
    fp8: bool  # computes in fp8 (fp8 KV pages and weights need it on a GPU)
    description: str  # the device kind (TPU) or the GPU's name in XLA's target descriptions
    # TPU slices: dimensions of the chip grid, chips per host, TensorCores counted per chip in the name
    grid_dims: int = 0
    chips_per_host: int = 8
    cores_in_name: int = 1
    source: str = ""  # where the figures come from

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"


_CLOUD_TPU = "Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/<chip>)"
_NVIDIA = "NVIDIA datasheet (dense Tensor Core peaks); HBM as the device reports it (XLA's GPU description)"

CHIPS: dict[str, Chip] = {chip.name: chip for chip in (
    Chip("v4", "tpu", 32 * GIB, 1200 * GB, 275e12, 275e12, False, "TPU v4", grid_dims=3, chips_per_host=4,
         cores_in_name=2, source=_CLOUD_TPU),
    Chip("v5e", "tpu", 16 * GIB, 819 * GB, 197e12, 394e12, False, "TPU v5 lite", grid_dims=2, chips_per_host=8,
         source=_CLOUD_TPU),
    Chip("v5p", "tpu", 95 * GIB, 2765 * GB, 459e12, 918e12, False, "TPU v5", grid_dims=3, chips_per_host=4,
         cores_in_name=2, source=_CLOUD_TPU),
    Chip("v6e", "tpu", 32 * GIB, 1638 * GB, 918e12, 1836e12, False, "TPU v6 lite", grid_dims=2,
         chips_per_host=8, source=_CLOUD_TPU),
    Chip("a100", "gpu", 85_100_068_864, 2039 * GB, 312e12, 624e12, False, "NVIDIA A100-SXM4-80GB",
         source=_NVIDIA),
    Chip("h100", "gpu", 84_942_979_072, 3350 * GB, 989e12, 1979e12, True, "NVIDIA H100 80GB HBM3", source=_NVIDIA),
    Chip("h200", "gpu", 151_397_597_184, 4800 * GB, 989e12, 1979e12, True, "NVIDIA H200 141GB HBM3e",
         source=_NVIDIA),
    Chip("b200", "gpu", 191_514_411_008, 8000 * GB, 2250e12, 4500e12, True, "NVIDIA B200", source=_NVIDIA),
)}

GPUS_PER_HOST = 8

# Chip grids of the TPU slice shapes Cloud TPU offers (2-D: v5e, v6e; 3-D: v4, v5p), by chip count.
_GRIDS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
             512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user gave it, normalised: "v6e-8", "h100x8"
    chip: Chip
    chips: int  # devices of the engine's mesh
    hosts: int  # processes a serving run starts (one per host)
    topology: str  # what the compiler takes: "v6e:2x4" (TPU), "1x1x8" (GPU: slices x hosts x GPUs per host)

    @property
    def platform(self) -> str:
        return self.chip.platform

    def describe(self) -> str:
        hosts = f" on {self.hosts} hosts" if self.hosts > 1 else ""
        return f"{self.name}: {self.chips} x {self.chip.description}{hosts}"


TARGET_HELP = ("v4-N, v5e-N, v5p-N or v6e-N (Cloud TPU accelerator types: N chips on v5e and v6e, N "
               "TensorCores, two a chip, on v4 and v5p), or a100, h100, h200, b200 with xN for N GPUs")


def parse_target(text: str) -> Target:
    """`text` -> Target, or a ValueError that lists what is accepted."""
    name = text.strip().lower()
    tpu = re.fullmatch(r"(v4|v5e|v5litepod|v5p|v6e)-(\d+)", name)
    gpu = re.fullmatch(r"(a100|h100|h200|b200)(?:x(\d+))?", name)
    if tpu:
        chip = CHIPS["v5e" if tpu.group(1) == "v5litepod" else tpu.group(1)]
        return _tpu_target(chip, int(tpu.group(2)))
    if gpu:
        chip, count = CHIPS[gpu.group(1)], int(gpu.group(2) or 1)
        if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
            raise ValueError(f"{text!r}: up to {GPUS_PER_HOST} GPUs a host, or a multiple of {GPUS_PER_HOST}")
        hosts = max(1, count // GPUS_PER_HOST)
        name = chip.name if count == 1 else f"{chip.name}x{count}"
        return Target(name, chip, count, hosts, f"1x{hosts}x{count // hosts}")
    raise ValueError(f"unknown target {text!r}: expected {TARGET_HELP}")


def _tpu_target(chip: Chip, number: int) -> Target:
    if number % chip.cores_in_name:
        raise ValueError(f"{chip.name}-{number}: {chip.name} slices are named by TensorCores, "
                         f"{chip.cores_in_name} a chip")
    chips = number // chip.cores_in_name
    grids = _GRIDS_3D if chip.grid_dims == 3 else _GRIDS_2D
    if chips not in grids:
        sizes = ", ".join(f"{chip.name}-{n * chip.cores_in_name}" for n in grids)
        raise ValueError(f"{chip.name}-{number}: not a {chip.name} slice shape; one of {sizes}")
    # Single-host slices keep their chips on one host (v5e-8 and v6e-8 are one 8-chip VM); larger ones
    # are built of hosts of 4 chips, as Cloud TPU lays them out.
    hosts = 1 if chips <= chip.chips_per_host else chips // 4
    return Target(f"{chip.name}-{number}", chip, chips, hosts, f"{chip.name}:{grids[chips]}")
