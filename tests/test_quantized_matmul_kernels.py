"""Weight-only quantized products: the Triton and Mosaic kernels (CPU interpret mode) against
`quantized_matmul_reference`, and both compiled for the chips by their real compilers.

1. The sweep: every batch size the engine's decode buckets give the kernels (1, 7, 16, 64 rows), each with a
   weight layout QuantizedLinear holds (int8 per output channel, int4 per group, uint4 per group with zero
   points), K and N that are not multiples of the tiles where the layout allows (per-channel K of 172, N of
   200), float32 and bfloat16 x, rotated so each backend meets every row count, layout and dtype without
   running every combination in interpret mode (each case is a compile and a run of an interpreted grid).
2. The tiling paths the defaults may not reach on small shapes: Triton's K splits and a step over several
   scale groups; Mosaic's K steps and a step over several groups.
3. Compiled (`sharding/compile_only.py`) for H100, H200 (Triton, ptxas) and v5e, v6e (Mosaic), one shape per
   variant the engine can pick: one kernel launch, no copy or dequantized weight in the program, and the
   kernel's shared memory (read from XLA's thunk sequence) or VMEM (Mosaic's `used_scoped_memory_configs`)
   within the chip's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantized_matmul import quantized_matmul_reference
from pallas_kernels.quantized_matmul_gpu import default_tiles as gpu_tiles
from pallas_kernels.quantized_matmul_gpu import quantized_matmul_gpu
from pallas_kernels.quantized_matmul_tpu import quantized_matmul_tpu
from pallas_kernels.testing import INTERPRET_COMPILER_OPTIONS

# Kernel against the float32 reference, relative to the output's largest magnitude. float32: summation order
# only (measured up to 1.3e-6); bfloat16: the output's own rounding (2^-9 relative) plus, where a step spans
# several scale groups, the dequantized weights rounded to bf16 (measured: up to 4.0e-3).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
KERNELS = {"triton": quantized_matmul_gpu, "mosaic": quantized_matmul_tpu}


@dataclasses.dataclass(frozen=True)
class Layout:
    codes: str  # int8 | int4 | uint4 (with zero points)
    k: int
    n: int
    group: int | None = None  # input rows per scale; None: per output channel

    @property
    def name(self) -> str:
        return f"{self.codes}-{'channel' if self.group is None else f'g{self.group}'}-{self.k}x{self.n}"


LAYOUTS = (Layout("int8", 172, 200), Layout("int4", 256, 384, 32), Layout("uint4", 512, 200, 64),
           Layout("int4", 256, 256))
ROWS = (1, 7, 16, 64)
SWEEP = [(impl, rows, LAYOUTS[(i + j) % len(LAYOUTS)], ("float32", "bfloat16")[(i + j + (impl == "mosaic")) % 2])
         for j, impl in enumerate(KERNELS) for i, rows in enumerate(ROWS)]


def random_weight(layout: Layout, seed: int = 0):
    """(codes, scales, zeros) of `layout`, scaled so x @ W of unit-normal x has entries of about 1."""
    rng = np.random.default_rng(seed)
    groups = 1 if layout.group is None else layout.k // layout.group
    shape = (layout.k, layout.n)
    zeros = None
    if layout.codes == "int8":
        codes, top = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8), 127
    elif layout.codes == "int4":
        codes, top = jnp.asarray(rng.integers(-8, 8, shape), jnp.int4), 7
    else:
        codes, top = jnp.asarray(rng.integers(0, 16, shape), jnp.uint4), 8
        zeros = jnp.asarray(rng.integers(0, 17, (groups, layout.n)), jnp.int8)
    scales = rng.uniform(0.5, 1.5, (groups, layout.n)) / (top * np.sqrt(layout.k / 3))
    return codes, jnp.asarray(scales, jnp.float32), zeros


@functools.cache
def _interpreted(impl: str, static: frozenset):
    kernel = KERNELS[impl]
    return jax.jit(lambda x, c, s, z: kernel(x, c, s, z, interpret=True, **dict(static)),
                   compiler_options=INTERPRET_COMPILER_OPTIONS)


def check_against_reference(impl: str, rows: int, layout: Layout, dtype: str, **tiles) -> float:
    codes, scales, zeros = random_weight(layout, seed=rows)
    x = jnp.asarray(np.random.default_rng(rows + 1).standard_normal((rows, layout.k)), dtype)
    got = _interpreted(impl, frozenset(tiles.items()))(x, codes, scales, zeros)
    want = jax.jit(quantized_matmul_reference)(x, codes, scales, zeros)
    assert got.shape == (rows, layout.n) and got.dtype == x.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    assert error <= TOLERANCE[dtype], f"{impl} {layout.name} {rows} rows {dtype}: relative error {error:.2e}"
    return error


@pytest.mark.parametrize("impl,rows,layout,dtype", SWEEP,
                         ids=[f"{i}-{r}rows-{lay.name}-{d}" for i, r, lay, d in SWEEP])
def test_kernel_matches_reference(impl, rows, layout, dtype):
    check_against_reference(impl, rows, layout, dtype)


TILED = [
    ("triton", 3, Layout("int8", 512, 256), "float32", dict(num_splits=3)),  # 4 K steps over 3 splits
    ("triton", 5, Layout("uint4", 256, 128, 32), "bfloat16", dict(block_k=64)),  # a step over 2 groups
    ("mosaic", 3, Layout("int8", 512, 256), "bfloat16", dict(block_k=128)),  # 4 K steps, per-channel
    ("mosaic", 9, Layout("uint4", 512, 384, 32), "float32", dict(block_k=128, block_n=128)),  # 4 groups a step
]


@pytest.mark.parametrize("impl,rows,layout,dtype,tiles", TILED, ids=[f"{t[0]}-{t[4]}" for t in TILED])
def test_tiling_paths_match_reference(impl, rows, layout, dtype, tiles):
    check_against_reference(impl, rows, layout, dtype, **tiles)


def test_triton_default_tiles():
    # One row of a 4096 x 4096 int8 product: 128 column tiles of 32 (one per multiprocessor of an H100), split
    # 3 ways to reach ~264 programs.
    assert gpu_tiles(1, 4096, 4096, 4096, jnp.int8) == (32, 128, 3)
    # 64 rows: the float32 partials would outgrow an eighth of the codes' bytes past 2 splits.
    assert gpu_tiles(64, 4096, 4096, 4096, jnp.int8) == (32, 128, 2)
    # int4: 64-column tiles (32 bytes a row); each step inside one group, 256-row steps where it allows.
    assert gpu_tiles(16, 4096, 4096, 32, jnp.int4) == (64, 32, 4)
    assert gpu_tiles(16, 4096, 4096, 4096, jnp.int4) == (64, 256, 4)
    # A wide LM head has programs enough without narrower tiles or splits.
    assert gpu_tiles(16, 4096, 128256, 4096, jnp.int8) == (128, 128, 1)


BAD = [  # (what replaces a good argument: (shape, dtype), what the error says)
    (dict(x=((4, 64), "int32")), "x must be"),
    (dict(x=((4, 32), "float32")), "x has 32 features"),
    (dict(codes=((64, 32), "float32")), "codes must be"),
    (dict(scales=((3, 32), "float32")), "3 scale groups do not divide"),
    (dict(scales=((1, 16), "float32")), "scales must be float32"),
    (dict(zeros=((1, 32), "int8")), "uint4 codes need zero points"),
    (dict(codes=((64, 32), "uint4")), "uint4 codes need zero points"),
    (dict(codes=((64, 32), "uint4"), zeros=((1, 16), "int8")), "zeros must be int8"),
]


@pytest.mark.parametrize("impl", [*KERNELS, "reference"])
@pytest.mark.parametrize("bad,match", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_named(impl, bad, match):
    good = dict(x=((4, 64), "float32"), codes=((64, 32), "int8"), scales=((1, 32), "float32"), zeros=None)
    args = [None if a is None else jnp.zeros(*a) for a in (good | bad).values()]
    fn = quantized_matmul_reference if impl == "reference" else functools.partial(KERNELS[impl], interpret=True)
    with pytest.raises(ValueError, match=match):
        fn(*args)


@pytest.mark.parametrize("impl,tiles,match", [
    ("triton", dict(block_n=96), "block_n must be a power of 2"),
    ("triton", dict(block_k=48), "block_k must be a power of 2"),
    ("mosaic", dict(block_n=96), "block_n must be a multiple of 128"),
    ("mosaic", dict(block_k=64), "block_k must be a multiple of 128"),
])
def test_bad_tiles_are_named(impl, tiles, match):
    codes, scales, zeros = random_weight(Layout("int8", 256, 256))
    with pytest.raises(ValueError, match=match):
        KERNELS[impl](jnp.zeros((2, 256)), codes, scales, zeros, interpret=True, **tiles)


def test_groups_the_triton_kernel_cannot_tile_are_refused():
    codes, scales, _ = random_weight(Layout("int4", 96, 128, 24))
    with pytest.raises(ValueError, match="scale groups of a power of 2"):
        quantized_matmul_gpu(jnp.zeros((2, 96)), codes, scales, interpret=True)


# ---- compiled for the chips ---------------------------------------------------------------------------

# One shape per variant the engine runs: per-channel int8 at one row (Triton: split K), int4 groups of 128 at
# 16 rows, uint4 groups of 32 with zero points at 64 rows (Mosaic: a step over 32 groups), bf16 x; and a
# float32 model's int8 groups of 128 (compressed-tensors' group layout; full-precision dots).
VARIANTS = {"int8-channel": (1, Layout("int8", 4096, 4096), "bfloat16"),
            "int4-g128": (16, Layout("int4", 4096, 2048, 128), "bfloat16"),
            "uint4-g32": (64, Layout("uint4", 2048, 4096, 32), "bfloat16"),
            "int8-g128-f32": (8, Layout("int8", 2048, 2048, 128), "float32")}
CHIPS = {"h100": ("triton", 227 << 10), "h200": ("triton", 227 << 10), "v5e-1": ("mosaic", 128 << 20),
         "v6e-1": ("mosaic", 128 << 20)}


def compile_for(target: str, variant: str, dump_dir):
    """The variant's kernel compiled for `target`, XLA's dump (the thunk sequence) in `dump_dir`."""
    from sharding.chips import parse_target
    from sharding.compile_only import compile_devices
    rows, layout, dtype = VARIANTS[variant]
    weight = jax.eval_shape(lambda: random_weight(layout))
    x = jax.ShapeDtypeStruct((rows, layout.k), dtype)
    with jax.default_device(compile_devices(parse_target(target))[0]):
        lowered = jax.jit(KERNELS[CHIPS[target][0]]).lower(x, *weight)
        return lowered.compile(compiler_options={"xla_dump_to": str(dump_dir)})


def kernel_memory(target: str, compiled, dump_dir) -> int:
    """Shared memory of the Triton kernel (XLA's thunk sequence) or VMEM Mosaic uses, in bytes."""
    if CHIPS[target][0] == "triton":
        thunks = "\n".join(p.read_text() for p in dump_dir.glob("*thunk_sequence.txt"))
        return int(re.search(r"quantized_matmul_triton .*shared_memory: (\d+) bytes", thunks).group(1))
    call = next(line for line in compiled.as_text().splitlines() if 'custom_call_target="tpu_custom_call"' in line)
    config = re.search(r'"used_scoped_memory_configs":(\[[^]]*\])', call).group(1)
    return sum(int(c["size"]) for c in json.loads(config))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("target", list(CHIPS))
def test_compiles_for_the_chip(target, variant, tmp_path):
    rows, layout, _ = VARIANTS[variant]
    compiled = compile_for(target, variant, tmp_path)
    text = compiled.as_text()
    kernel = "__gpu$xla.gpu.triton" if CHIPS[target][0] == "triton" else "tpu_custom_call"
    assert text.count(f'custom_call_target="{kernel}"') == 1
    # The codes are read by the kernel alone: nothing converts, copies or dequantizes them around it (a split
    # product adds only its float32 partials, rows x N x splits).
    assert compiled.memory_analysis().temp_size_in_bytes <= 32 * rows * layout.n * 4
    assert 0 < kernel_memory(target, compiled, tmp_path) <= CHIPS[target][1]
