"""Qwen2.5-VL's vision encoder as fixed-shape programs: images of any size, in calls padded to a bucket of patches.

1. Qwen's processor resizes each image to its own grid of 14-pixel patches, between min_pixels and max_pixels,
   so the encoder's varying dimension is patches: a few buckets (`patch_buckets`: the largest image the
   processor makes, then quarters of it down to its smallest image), each one jitted program over the
   encoder's parameters and a `VisionLayout` (window order, segments, each patch's row and column), compiled
   and run once at warm-up (`warmup`), never while serving.
2. `encode(images)` packs the images, in order, into calls of at most the largest bucket's patches, computes
   each call's layout on the host (`model/qwen_vit.vision_layout`, padded to the smallest bucket that holds
   the call) and returns each image's rows (one per merged token) on the host in the language model's dtype,
   as `vision.VisionEncoderProgram` does for fixed-size images: the encoder cache keeps them by content hash.
The encoder runs whole on one device (the first of the mesh), its rows going to the step replicated.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxserve.model.qwen_vit import vision_layout
from jaxserve.vision_config import QwenVisionConfig


@dataclasses.dataclass(frozen=True, eq=False)
class PatchedImage:
    """One image as the encoder takes it (the pixels an `ImageSpan` carries until the image is encoded)."""
    patches: np.ndarray  # [grid_t * grid_h * grid_w, C * T * P * P] float32, the processor's order
    grid: tuple[int, int, int]  # (grid_t, grid_h, grid_w) in patches


def patch_buckets(min_patches: int, max_patches: int, merge_unit: int) -> tuple[int, ...]:
    """`max_patches`, then a quarter of it at a time while that still holds `min_patches`, each rounded up to
    whole merge units: a call pads to at most four times its patches (the smallest bucket aside)."""
    round_up = lambda n: -(-n // merge_unit) * merge_unit
    buckets, size = [round_up(max_patches)], max_patches // 4
    while size >= min_patches:
        buckets.append(round_up(size))
        size //= 4
    return tuple(sorted(set(buckets)))


class PatchEncoderProgram:
    def __init__(self, encoder: nnx.Module, config: QwenVisionConfig, dtype, buckets: tuple[int, ...], device=None):
        """`encoder`: patches [N, patch_dim] and their `VisionLayout` -> rows [N / merge_unit, text hidden];
        `dtype`: the rows' dtype (the language model's). Its compilations count toward the runner's
        `CompileEvents` (the runner calls it inside its counting)."""
        graphdef, state = nnx.split(encoder)
        self.config = config
        self.device = device or jax.devices()[0]
        self._params = jax.device_put(state, self.device)
        self.buckets = tuple(sorted(buckets))
        self._encode = jax.jit(lambda params, patches, layout: nnx.merge(graphdef, params)(patches, layout).astype(dtype))

    @property
    def max_patches(self) -> int:
        return self.buckets[-1]

    def warmup(self) -> None:
        """Compile (and run once) every bucket's program, on padding alone."""
        for bucket in self.buckets:
            jax.block_until_ready(self._run([], bucket))

    def _run(self, images: list[PatchedImage], bucket: int) -> jax.Array:
        patches = np.zeros((bucket, self.config.patch_dim), np.float32)
        filled = 0
        for image in images:
            patches[filled:filled + len(image.patches)] = image.patches
            filled += len(image.patches)
        layout = vision_layout([image.grid for image in images], self.config, bucket)
        return self._encode(self._params, *jax.device_put((patches, layout), self.device))

    def encode(self, images: list[PatchedImage]) -> list[np.ndarray]:
        """Each image's rows [patches / merge_unit, hidden], on the host (every image within `max_patches`)."""
        out: list[np.ndarray] = []
        while len(out) < len(images):
            call, patches = [], 0
            for image in images[len(out):]:
                if call and patches + len(image.patches) > self.max_patches:
                    break
                call.append(image)
                patches += len(image.patches)
            bucket = next(b for b in self.buckets if b >= patches)
            rows = np.asarray(self._run(call, bucket))
            first = 0
            for image in call:
                n = len(image.patches) // self.config.merge_unit
                out.append(rows[first:first + n])
                first += n
        return out
