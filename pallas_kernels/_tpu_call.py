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
Quantized pages (`kv_quant.py`) add two HBM operands, the lane-dense per-token scales, and two VMEM
buffers: each page's row of scales (128 of them, the page's own page_size at a lane offset; or its whole
rows for pages of 128 tokens and more) travels with its codes (same semaphore, own wait), and
`block_scales` rotates each page's share into place to give the block's keys' scales as one row. A block
costs a quarter (int8 / fp8 against float32) of the bytes plus one 512-byte row per page and head.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._paged_common import MASK_VALUE, block_scores, online_softmax_step, tpu_interpret_params
from pallas_kernels.kv_quant import SCALE_LANES


class PagedRefs(NamedTuple):
    """One layer's K/V in HBM (`[num_kv_heads, num_pages, page_size, head_dim]`, scales lane-dense
    `[num_kv_heads, rows, 128]`), or their VMEM double buffers (`[2, pages_per_block, page_size, head_dim]`,
    scales `[2, pages_per_block * rows_per_page, 128]`); scales None for float pages."""
    k: object
    v: object
    k_scales: object = None
    v_scales: object = None


def split_kernel_refs(refs, quantized: bool):
    """The refs after the query block, in `paged_flash_call`'s order -> (hbm, o_ref, bufs, sems, m, l, acc).

    Order: k, v HBM, [k_scales, v_scales HBM], o, k, v buffers, sems, m, l, acc, [k_scales, v_scales
    buffers]. m and l are [rows, 1] and acc [rows, head_dim] float32; sems is DMA [2 (k, v), 2 (slot)].
    """
    n = 2 if quantized else 0
    hbm = PagedRefs(*refs[:2 + n])
    o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs[2 + n:9 + n]
    bufs = PagedRefs(k_buf, v_buf, *refs[9 + n:])
    return hbm, o_ref, bufs, sems, m_ref, l_ref, acc_ref


def init_softmax_state(m_ref, l_ref, acc_ref) -> None:
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def normalised_output(l_ref, acc_ref) -> jax.Array:
    """acc / l in float32; rows that saw no key (l == 0: padding) come out as zeros, not NaN."""
    l = l_ref[...]
    return acc_ref[...] / jnp.where(l > 0, l, 1.0)


def rows_per_page(page_size: int) -> int:
    """Rows of lane-dense scales a page's DMA brings: the one holding its scales, or its own whole rows."""
    return max(1, page_size // SCALE_LANES)


def block_scales(rows: jax.Array, lane_offsets: list, page_size: int) -> jax.Array:
    """A key block's scales as one row [1, block_k], from its pages' DMA'd rows [pages * rows_per_page, 128].

    A page of fewer than 128 tokens has its scales at `lane_offsets[j]` (dynamic) of its row: a lane
    rotation moves them to lanes j * page_size.. of the block's chunk of 128 keys, and a lane mask keeps
    them. Pages of 128 tokens and more are their rows, in order."""
    pages = len(lane_offsets)
    if page_size >= SCALE_LANES:
        return rows.reshape(1, pages * page_size)
    per_chunk = SCALE_LANES // page_size  # pages whose keys share one 128-lane chunk of the block
    owner = lax.broadcasted_iota(jnp.int32, (1, SCALE_LANES), 1) // page_size
    chunks = []
    for first in range(0, pages, per_chunk):
        chunk = jnp.zeros((1, SCALE_LANES), jnp.float32)
        for j in range(first, min(first + per_chunk, pages)):
            shift = lax.rem((j - first) * page_size - lane_offsets[j] + SCALE_LANES, SCALE_LANES)
            chunk = jnp.where(owner == j - first, pltpu.roll(rows[j:j + 1], shift, 1), chunk)
        chunks.append(chunk)
    row = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)
    return row[:, :pages * page_size]


def attend_paged_blocks(q: jax.Array, page_id: Callable, hbm: PagedRefs, bufs: PagedRefs, sems, m_ref, l_ref,
                        acc_ref, *, kv_head, start_blk, num_iters, mask: Callable, sm_scale: float,
                        soft_cap: float | None, precision) -> None:
    """Fold key blocks start_blk .. start_blk + num_iters - 1 of one sequence into the running softmax of
    q [rows, head_dim].

    `page_id(i)` is the i-th page of the sequence (a scalar-prefetched table read); `mask(blk)` gives the
    [rows, block_k] keys each row may see in block `blk` (all False for rows of other sequences). Every
    copy started here is waited for here, so consecutive calls never share a DMA in flight.
    """
    _, pages_per_block, page_size, head_dim = bufs.k.shape
    block_k = pages_per_block * page_size
    quantized = bufs.k_scales is not None
    rpp = rows_per_page(page_size)

    def scale_row(page):  # the first row of lane-dense scales holding the page's, and its lane offset there
        return lax.div(page * page_size, SCALE_LANES), lax.rem(page * page_size, SCALE_LANES)

    def copies(blk, slot):
        out = []
        for j in range(pages_per_block):
            page = page_id(blk * pages_per_block + j)
            # K on semaphore row 0, V on row 1; a page's scales share its codes' row.
            for sem, (src, dst) in enumerate(((hbm.k, bufs.k), (hbm.v, bufs.v))):
                out.append(pltpu.make_async_copy(src.at[kv_head, page], dst.at[slot, j], sems.at[sem, slot]))
            if quantized:
                row = pl.ds(scale_row(page)[0], rpp)
                for sem, (src, dst) in enumerate(((hbm.k_scales, bufs.k_scales), (hbm.v_scales, bufs.v_scales))):
                    out.append(pltpu.make_async_copy(src.at[kv_head, row], dst.at[slot, pl.ds(j * rpp, rpp)],
                                                     sems.at[sem, slot]))
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
        k = bufs.k[slot].reshape(block_k, head_dim)
        v = bufs.v[slot].reshape(block_k, head_dim)
        k_scale = v_scale = None
        if quantized:  # codes -> q's dtype is exact; the scales multiply scores and value weights
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            lanes = [scale_row(page_id(blk * pages_per_block + j))[1] for j in range(pages_per_block)]
            k_scale = block_scales(bufs.k_scales[slot], lanes, page_size)
            v_scale = block_scales(bufs.v_scales[slot], lanes, page_size)
        s = block_scores(q, k, sm_scale=sm_scale, soft_cap=soft_cap, precision=precision, k_scale=k_scale)
        acc_ref[...], m_ref[...], l_ref[...] = online_softmax_step(acc_ref[...], m_ref[...], l_ref[...], s,
                                                                   mask(blk), v, precision, v_scale)
        return carry

    lax.fori_loop(0, num_iters, body, 0)


def paged_flash_call(kernel, scalars: tuple[jax.Array, ...], q4: jax.Array, kv: PagedRefs, *,
                     grid: tuple[int, int], q_spec: pl.BlockSpec, rows: int, pages_per_block: int, name: str,
                     interpret, row_inputs: tuple[tuple[jax.Array, pl.BlockSpec], ...] = ()) -> jax.Array:
    """pallas_call of `kernel(*scalar_refs, q_ref, *row_refs, *refs)`, refs as `split_kernel_refs` unpacks
    them, over the cache arrays `kv` (scales None for float pages). `row_inputs` are more VMEM blocks beside
    the query block: (array, its BlockSpec) each (the ragged kernel's per-row span reach)."""
    _, _, page_size, head_dim = kv.k.shape
    quantized = kv.k_scales is not None
    operands = kv if quantized else kv[:2]
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), kv.k.dtype)
    scale_rows = pages_per_block * rows_per_page(page_size)
    scale_bufs = [pltpu.VMEM((2, scale_rows, SCALE_LANES), kv.k_scales.dtype)] * 2 if quantized else []
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=grid,
        in_specs=[q_spec] + [spec for _, spec in row_inputs] + [pl.BlockSpec(memory_space=pl.ANY)] * len(operands),
        out_specs=q_spec,
        scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32), *scale_bufs],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=tpu_interpret_params(interpret),
        name=name,
    )(*scalars, q4, *[x for x, _ in row_inputs], *operands)
