"""The `pallas_call` both Mosaic (TPU) paged-attention kernels share.

Decode and prefill differ in their grid and query block, not in how they run:
1. two scalar-prefetch operands (lengths/metadata and the page table) land in SMEM before the grid starts;
2. the query block comes in through VMEM by its BlockSpec, K/V pages stay in HBM (`pl.ANY`) and the kernel
   copies them itself into a double-buffered VMEM scratch, with one DMA semaphore per buffer half and
   K/V;
3. the online softmax keeps its running max, sum ([rows, 1]) and accumulator ([rows, head_dim]) in
   float32 VMEM scratch; both grid axes are independent ("parallel").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import tpu_interpret_params


def paged_flash_call(kernel, scalars: tuple[jax.Array, jax.Array], q4: jax.Array, k_pages: jax.Array,
                     v_pages: jax.Array, *, grid: tuple[int, int], q_spec: pl.BlockSpec, rows: int,
                     pages_per_block: int, name: str, interpret) -> jax.Array:
    _, _, page_size, head_dim = k_pages.shape
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=grid,
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32)],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_params(interpret),
        name=name,
    )(*scalars, q4, k_pages, v_pages)
