"""A decode step's q/k/v product epilogue on GPUs: q, K and V from the split product, one kernel (issue 52).

XLA ran a decode layer's q/k/v product split along K, then three kernels over its float32 partials: K (sum,
rope, scatter into the pages), V (sum, scatter) and q (sum, rope, padding for attention). Given the partials
of an explicitly split product ([S, T, (H + 2 KVH) x D], `jaxserve/model/split_k.py`), one Triton program
per token here:
1. sums the token's S partials of each head in float32 (times an int8 layer's per-column scales) and rounds
   them to the product's dtype, as the product's output is rounded;
2. rotates q and K in the rotate-half layout (`jaxserve/model/rope.py`'s `apply_rope`: float32, rounded);
3. stores q `[T, H, D]` (the attention kernel reads it as it is: ragged_gpu.py pads only a group that is not
   a power of 2), and K and V at the token's flat slot of the pages `[KVH, pages, page size, D]`, which the
   kernel is handed and returns in place (`input_output_aliases`; the step donates them: nothing is copied).
So the product's 4 kernels a layer are 2. `qkv_epilogue_reference` is the same in `jnp` (page_write.py's
scatter), what the kernel is tested against. Float pages only; power-of-2 head counts and head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._paged_common import is_pow2
from pallas_kernels.page_write import write_token_rows


def product_heads(partials: jax.Array, column_scale: jax.Array | None, first: int, count: int, head_dim: int, dtype):
    """Heads first .. first + count - 1 of the product the partials [S, T, heads x head_dim] sum to, rounded
    to `dtype` as the product's output: [T, count, head_dim]."""
    cols = slice(first * head_dim, (first + count) * head_dim)
    total = jnp.sum(partials[:, :, cols], axis=0)
    total = total if column_scale is None else total * column_scale[cols]
    return total.astype(dtype).reshape(total.shape[0], count, head_dim)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def qkv_epilogue_reference(partials: jax.Array, cos: jax.Array, sin: jax.Array, write_index: jax.Array,
                           k_pages: jax.Array, v_pages: jax.Array, *, num_heads: int, dtype,
                           column_scales: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """partials [S, T, (num_heads + 2 KVH) x D] float32 (q, k, v columns), cos / sin [T, D / 2] float32, write
    slots [T], pages [KVH, P, page size, D] -> (roped q [T, num_heads, D] in `dtype`, the pages with each
    token's roped K and its V at its slot); `dtype`: the product's, its sums rounded to it first;
    `column_scales`: an int8 layer's per-column scales of q, k and v ([H x D], [KVH x D] twice)."""
    num_kv_heads, head_dim = k_pages.shape[0], k_pages.shape[3]
    column_scale = None if column_scales is None else jnp.concatenate(column_scales)
    q, k, v = (product_heads(partials, column_scale, first, count, head_dim, dtype)
               for first, count in ((0, num_heads), (num_heads, num_kv_heads), (num_heads + num_kv_heads, num_kv_heads)))
    q, k = (_rope(x, cos[:, None, :], sin[:, None, :]) for x in (q, k))
    return q, write_token_rows(k_pages, write_index, k), write_token_rows(v_pages, write_index, v)


def fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return is_pow2(num_heads) and is_pow2(num_kv_heads) and is_pow2(head_dim) and head_dim >= 16


def _kernel(*refs, num_heads: int, num_kv_heads: int, scaled: bool, dtype):
    # refs: write slots [T] int32, cos / sin [D / 2] (this token's), partials [S, heads, D] (this token's),
    # q, k and v's scales [H or KVH, D] (`scaled` only), the pages in (aliased, unread); out: q [H, D] (this
    # token's), the pages [KVH, slots, D].
    slots_ref, cos_ref, sin_ref, partials_ref, *refs = refs
    scale_refs, refs = (refs[:3], refs[3:]) if scaled else ((None,) * 3, refs)
    _, _, q_ref, k_ref, v_ref = refs
    head_dim = partials_ref.shape[2]
    half = head_dim // 2

    def heads(first: int, count: int, cols: pl.Slice, scale_ref):  # [count, len(cols)] of the rounded product
        rows = pl.ds(first, count)
        total = partials_ref[0, rows, cols]
        for s in range(1, partials_ref.shape[0]):  # S is static and small: one [count, cols] load each
            total = total + partials_ref[s, rows, cols]
        if scale_ref is not None:
            total = total * scale_ref[:, cols]
        return total.astype(dtype)

    cos, sin = cos_ref[...][None, :], sin_ref[...][None, :]

    def roped(first: int, count: int, scale_ref):
        x1, x2 = (heads(first, count, c, scale_ref).astype(jnp.float32) for c in (pl.ds(0, half), pl.ds(half, half)))
        return (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)

    q1, q2 = roped(0, num_heads, scale_refs[0])
    q_ref[:, pl.ds(0, half)] = q1.astype(q_ref.dtype)
    q_ref[:, pl.ds(half, half)] = q2.astype(q_ref.dtype)
    slot = pl.ds(slots_ref[pl.program_id(0)], 1)
    k1, k2 = roped(num_heads, num_kv_heads, scale_refs[1])
    k_ref[:, slot, pl.ds(0, half)] = k1.astype(k_ref.dtype)[:, None, :]
    k_ref[:, slot, pl.ds(half, half)] = k2.astype(k_ref.dtype)[:, None, :]
    v = heads(num_heads + num_kv_heads, num_kv_heads, pl.ds(0, head_dim), scale_refs[2])
    v_ref[:, slot, :] = v.astype(v_ref.dtype)[:, None, :]


@functools.partial(jax.jit, static_argnames=("num_heads", "dtype", "interpret"))
def qkv_epilogue_gpu(partials: jax.Array, cos: jax.Array, sin: jax.Array, write_index: jax.Array, k_pages: jax.Array,
                     v_pages: jax.Array, *, num_heads: int, dtype, column_scales: tuple[jax.Array, ...] | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`qkv_epilogue_reference` as one Triton kernel, a program per token, writing the pages in place."""
    num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
    splits, tokens, columns = partials.shape
    heads = num_heads + 2 * num_kv_heads
    if columns != heads * head_dim or v_pages.shape != k_pages.shape:
        raise ValueError(f"partials {partials.shape} do not hold {num_heads} q heads and the K / V heads of pages "
                         f"{k_pages.shape}, {v_pages.shape}")
    if not interpret and not fits(num_heads, num_kv_heads, head_dim):
        raise ValueError(f"the q/k/v epilogue kernel takes power-of-2 head counts and head_dim >= 16, got "
                         f"{num_heads}, {num_kv_heads} and {head_dim}")
    flat = (num_kv_heads, num_pages * page_size, head_dim)  # a token's rows at one flat slot: a free reshape
    half = head_dim // 2
    token = lambda *block: pl.BlockSpec((None, *block), lambda t: (t,) + (0,) * len(block))
    whole = lambda shape: pl.BlockSpec(shape, lambda t: (0,) * len(shape))
    scales = () if column_scales is None else tuple(s.astype(jnp.float32).reshape(-1, head_dim) for s in column_scales)
    dtype = jnp.dtype(dtype)
    q, k_out, v_out = pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, scaled=bool(scales), dtype=dtype),
        grid=(tokens,),
        in_specs=[whole((tokens,)), token(half), token(half),
                  pl.BlockSpec((splits, None, heads, head_dim), lambda t: (0, t, 0, 0)),
                  *[whole(s.shape) for s in scales], whole(flat), whole(flat)],
        out_specs=[token(num_heads, head_dim), whole(flat), whole(flat)],
        out_shape=[jax.ShapeDtypeStruct((tokens, num_heads, head_dim), dtype),
                   *[jax.ShapeDtypeStruct(flat, k_pages.dtype)] * 2],
        input_output_aliases={4 + len(scales): 1, 5 + len(scales): 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qkv_epilogue",
    )(write_index.astype(jnp.int32), cos, sin, partials.reshape(splits, tokens, heads, head_dim), *scales,
      k_pages.reshape(flat), v_pages.reshape(flat))
    return q, k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
