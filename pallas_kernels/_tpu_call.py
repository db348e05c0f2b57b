"""The Mosaic (TPU) side of ragged paged attention: the pallas_call and the page-streaming loop.

1. Scalar-prefetch operands (lengths, row offsets, page tables, per-block sequence ranges) land in SMEM
   before the grid starts, so a kernel can address pages with them.
2. The query block comes in through VMEM by its BlockSpec; K/V pages stay in HBM (`pl.ANY`) and the kernel
   copies them itself into a double-buffered VMEM scratch, with one DMA semaphore per buffer half and
   K/V.
3. The online softmax keeps its running max, sum ([rows, 1]) and accumulator ([rows, head_dim]) in float32
   VMEM scratch. A grid step sets it up once (`init_softmax_state`), folds in as many key streams as
   it likes (`attend_paged_blocks`, one per sequence whose rows share the query block, each masking
   the rows that are not its own), and normalises once at the end (`normalised_output`).
The double-buffered DMA protocol (start block i+1, wait for block i, compute) lives here once.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import MASK_VALUE, block_scores, online_softmax_step, tpu_interpret_params


def init_softmax_state(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def normalised_output(l_ref, acc_ref) -> jax.Array:
    """acc / l in float32; rows that saw no key (l == 0: padding) come out as zeros, not NaN."""
    l = l_ref[...]
    return acc_ref[...] / jnp.where(l > 0, l, 1.0)


def attend_paged_blocks(q: jax.Array, page_id: Callable, k_hbm_ref, v_hbm_ref, k_buf, v_buf, sems, m_ref, l_ref,
                        acc_ref, *, kv_head, start_blk, num_iters, mask: Callable, sm_scale: float,
                        soft_cap: float | None, precision) -> None:
    """Fold key blocks start_blk .. start_blk + num_iters - 1 of one sequence into the running softmax of
    q [rows, head_dim].

    `page_id(i)` is the i-th page of the sequence (a scalar-prefetched table read); `mask(blk)` gives the
    [rows, block_k] keys each row may see in block `blk` (all False for rows of other sequences). Every
    copy started here is waited for here, so consecutive calls never share a DMA in flight.
    """
    _, pages_per_block, page_size, head_dim = k_buf.shape
    block_k = pages_per_block * page_size

    def copies(blk, slot):
        out = []
        for j in range(pages_per_block):
            page = page_id(blk * pages_per_block + j)
            out.append(pltpu.make_async_copy(k_hbm_ref.at[kv_head, page], k_buf.at[slot, j], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm_ref.at[kv_head, page], v_buf.at[slot, j], sems.at[1, slot]))
        return out

    @pl.when(num_iters > 0)
    def _():
        for c in copies(start_blk, 0):
            c.start()

    def body(i, carry):
        blk = start_blk + i
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < num_iters)
        def _():  # prefetch the next block into the other buffer half
            for c in copies(blk + 1, 1 - slot):
                c.start()

        for c in copies(blk, slot):
            c.wait()
        k = k_buf[slot].reshape(block_k, head_dim)
        v = v_buf[slot].reshape(block_k, head_dim)
        s = block_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision)
        acc_ref[...], m_ref[...], l_ref[...] = online_softmax_step(acc_ref[...], m_ref[...], l_ref[...], s,
                                                                   mask(blk), v, precision)
        return carry

    lax.fori_loop(0, num_iters, body, 0)


def paged_flash_call(kernel, scalars: tuple[jax.Array, ...], q4: jax.Array, k_pages: jax.Array,
                     v_pages: jax.Array, *, grid: tuple[int, int], q_spec: pl.BlockSpec, rows: int,
                     pages_per_block: int, name: str, interpret) -> jax.Array:
    """pallas_call of `kernel(*scalar_refs, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, m, l, acc)`."""
    _, _, page_size, head_dim = k_pages.shape
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
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
