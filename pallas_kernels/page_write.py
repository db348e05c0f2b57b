"""How a step's new tokens land in a layer's pages, in the form each compiler writes in place.

Pages are `[num_kv_heads, num_pages, page_size, head_dim]` on every backend (`reference.py`); a step
writes its N new tokens' head vectors ([N, num_kv_heads, head_dim]; for quantized pages also their scales,
[N, num_kv_heads], into the lane-dense scales of `kv_quant.py`) at flat slots `page * page_size + offset`.
One XLA scatter does it, in one of two forms; `write_token_rows` picks per platform with
`lax.platform_dependent`, so a program compiled for a TPU gets the TPU's form wherever it is lowered:
1. TPU (`head_windows`): one update per (KV head, token) at (head, row, offset in row), its window a
   single head vector (or scale);
2. CPU and GPU (`token_windows`): the pages viewed flat, `[num_kv_heads, slots, ...]` (a free reshape
   there), one update per token, its window the token's rows of every head.
The step donates the pages, so XLA updates them in place.

Why two forms. XLA's TPU scatter wants each update's window contiguous in memory, so a token's window
of every head, over head-major pages, asked for a token-major physical layout, while the Mosaic kernel
(`ragged_tpu.py`) pins the default one: XLA copied every layer's K and V to the scatter's layout and back,
8.7 GB of copies a step for an unrolled 8-layer Llama-3-8B-shaped v6e step (8257 pages of 16) and 69 GB
with the layers scanned. A one-head window is contiguous in the default layout, and the
same programs compile with no copy of the cache (docs/performance.md, "The KV write on TPUs"). XLA:CPU
runs the per-token form faster (256-2048-token writes 1.6-5.0x, a 16-token decode write 1.15-1.2x),
and the H200 already updates the cache in place with it.
A token-major page layout shared with the kernel was the other way out; it pads the heads axis to
Mosaic's tile wherever a device holds fewer KV heads than one 32-bit word packs (1 for bf16, 1-2 for
int8 / fp8: tensor parallelism over a model's KV heads), and with the padding the copies came back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def head_windows(pages: jax.Array, write_index: jax.Array, rows: jax.Array) -> jax.Array:
    """The TPU's form: N * num_kv_heads updates at (head, slot), each one head's row (or scale)."""
    kvh, per_row = pages.shape[0], pages.shape[2]  # slots per row: page_size, or the scales' lanes
    n, tail = write_index.shape[0], rows.shape[2:]
    heads = jnp.broadcast_to(jnp.arange(kvh, dtype=jnp.int32), (n, kvh)).reshape(-1)
    slots = jnp.repeat(write_index.astype(jnp.int32), kvh)  # token by token, as rows.reshape(n * kvh, ...)
    # Indexed in place, not through a flat view: the scales' (8, 128) tiles make their flat view a relayout.
    return pages.at[heads, slots // per_row, slots % per_row].set(rows.reshape(n * kvh, *tail).astype(pages.dtype))


def token_windows(pages: jax.Array, write_index: jax.Array, rows: jax.Array) -> jax.Array:
    """The CPU's and GPU's form: N updates at slot, each the token's rows (or scales) of every head."""
    flat = pages.reshape(pages.shape[0], -1, *rows.shape[2:])
    return flat.at[:, write_index].set(jnp.moveaxis(rows, 0, 1).astype(pages.dtype)).reshape(pages.shape)


def write_token_rows(pages: jax.Array, write_index: jax.Array, rows: jax.Array) -> jax.Array:
    """rows [N, num_kv_heads, head_dim] (the new tokens' head vectors) written at flat slots write_index [N]
    of pages [num_kv_heads, num_pages, page_size, head_dim]; or rows [N, num_kv_heads] (their scales) into
    lane-dense scales (`kv_quant.scales_shape`). Cast to the pages' dtype, in the form the compiling
    platform writes in place."""
    return lax.platform_dependent(pages, write_index, rows, tpu=head_windows, default=token_windows)
