"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL): three position axes (time, row, column).

1. `mrope_positions` (host, numpy, once per request at admission): text tokens advance all three axes
   together, one per token; an image's tokens (its merged patch grid, grid_t x grid_h/m x grid_w/m) all
   start from the position after the text before it and spread over the grid: time = start + frame,
   row = start + grid row, column = start + grid column; the text after the image continues at
   start + max(grid_h, grid_w) / m. So positions run behind token indices by a fixed `delta` after the
   last image (negative when images are large): a token at sequence index i past the last image sits at
   i + delta on every axis, which is all decoding needs (`text_positions`). `PromptPositions` keeps a
   request's table up to its last image and its delta; the batch builder fills each step's [3, T]
   positions from it (`fill`), so a chunk, a recomputation after preemption or a prefix-cache hit gets its
   positions from the request, never from the cache.
2. `mrope_cos_sin` (device, inside the step): the rotary angles of each frequency come from one axis,
   chosen by `mrope_section` (e.g. [16, 24, 24] of head_dim / 2 = 64 frequencies: the first 16 from time,
   the next 24 from rows, the last 24 from columns), giving the [N, head_dim / 2] cos and sin that
   `rope.apply_rope` takes, as for 1-D RoPE. Chunked prefill slices the [3, L] positions like token ids.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def mrope_positions(token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """(positions [3, len(token_ids)] int32, delta) for a prompt whose runs of `image_token_id` are, in order,
    the images of patch grids `grids` ((t, h, w) each, before merging)."""
    ids = np.asarray(token_ids)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    runs = list(zip(edges[::2].tolist(), edges[1::2].tolist()))
    m = spatial_merge_size
    sizes = [t * (h // m) * (w // m) for t, h, w in grids]
    if [end - start for start, end in runs] != sizes:
        raise ValueError(f"image token runs {[end - start for start, end in runs]} do not match the images' "
                         f"merged grids {sizes}")
    pieces, cursor, pos = [], 0, 0  # cursor: next token index; pos: next position
    for (start, end), (t, h, w) in zip(runs, grids):
        text = start - cursor
        pieces.append(np.broadcast_to(np.arange(pos, pos + text), (3, text)))
        pos += text
        frame, row, col = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
        pieces.append(np.stack([frame, row, col]).reshape(3, -1) + pos)
        pos += max(h, w) // m
        cursor = end
    tail = len(ids) - cursor
    pieces.append(np.broadcast_to(np.arange(pos, pos + tail), (3, tail)))
    positions = np.concatenate(pieces, axis=1).astype(np.int32)
    delta = int(positions.max(initial=-1)) + 1 - len(ids)
    return positions, delta


@dataclasses.dataclass(frozen=True, eq=False)
class PromptPositions:
    """A prompt's M-RoPE positions as a step needs them: the table up to the end of its last image; every
    later token (the rest of the prompt, then the output) at its index + `delta` on all three axes."""
    table: np.ndarray  # [3, E] int32: positions of tokens 0 .. E - 1 (E: the last image's end)
    delta: int

    @classmethod
    def of(cls, token_ids: Sequence[int], image_token_id: int, grids: Sequence[tuple[int, int, int]],
           spatial_merge_size: int, image_end: int) -> PromptPositions:
        """`image_end`: the index after the prompt's last image token (the table's length)."""
        positions, delta = mrope_positions(token_ids, image_token_id, grids, spatial_merge_size)
        return cls(np.ascontiguousarray(positions[:, :image_end]), delta)

    def fill(self, out: np.ndarray, start: int) -> None:
        """Overwrite out [3, n] (already index + delta) with the table's positions of tokens start.. ."""
        end = min(self.table.shape[1], start + out.shape[1])
        if start < end:
            out[:, :end - start] = self.table[:, start:end]


def text_positions(start: int, count: int, delta: int) -> np.ndarray:
    """[3, count] positions of the tokens at sequence indices start.. after the prompt's last image."""
    return np.broadcast_to(np.arange(start + delta, start + delta + count, dtype=np.int32), (3, count))


def mrope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, sections: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """positions [3, N] -> cos, sin [N, head_dim // 2] in float32, frequency j turned by the axis that
    `sections` assigns it (section i -> axis i % 3)."""
    if sum(sections) != len(inv_freq):
        raise ValueError(f"mrope_section {list(sections)} must add up to head_dim / 2 = {len(inv_freq)}")
    axis = np.concatenate([np.full(size, i % 3) for i, size in enumerate(sections)])
    picked = jnp.take(positions, jnp.asarray(axis), axis=0)  # [head_dim / 2, N]: each frequency's axis
    angles = picked.T.astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)[None, :]
    return jnp.cos(angles), jnp.sin(angles)
