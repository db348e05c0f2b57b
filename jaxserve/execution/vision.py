"""The vision encoder as its own fixed-shape program: images in, the rows that replace their placeholder tokens.

1. Gemma 3's images are all one size (the processor resizes them), so the encoder's only varying dimension is
   how many images one call takes: a few buckets (1, 2, 4 by default), each one jitted program over the
   encoder's parameters, compiled at warm-up (`warmup`), never while serving.
2. `encode(pixels)` runs the images in calls of the buckets' sizes (the last one padded with blank images,
   whose rows are dropped) and returns each image's rows on the host, in the language model's dtype: the
   engine keeps them in the encoder cache by the image's content hash (`scheduling/encoder_cache.py`), and
   each step gathers the rows it places from there (`image_rows.py`).
The encoder runs whole on one device (the first of the mesh): it is small next to the language model, and
its rows cross to the step's devices replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DEFAULT_BUCKETS = (1, 2, 4)


class VisionEncoderProgram:
    def __init__(self, encoder: nnx.Module, image_shape: tuple[int, ...], dtype, device=None,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS):
        """`encoder`: images [B, *image_shape] float32 -> rows [B, tokens per image, text hidden]; `dtype`: the
        rows' dtype (the language model's). Its compilations count toward the runner's `CompileEvents` (the
        runner calls it inside its counting)."""
        graphdef, state = nnx.split(encoder)
        self.device = device or jax.devices()[0]
        self._params = jax.device_put(state, self.device)
        self.image_shape = tuple(image_shape)
        self.buckets = tuple(sorted(buckets))
        self._encode = jax.jit(lambda params, pixels: nnx.merge(graphdef, params)(pixels).astype(dtype))

    def warmup(self) -> None:
        """Compile (and run once) every bucket's program."""
        for bucket in self.buckets:
            jax.block_until_ready(self._run(np.zeros((bucket, *self.image_shape), np.float32)))

    def lower(self, bucket: int, device=None):
        """The program of `bucket` images lowered for `device` (default: its own), not run: compiled ahead for
        a chip that is not here (tests/test_compiled_steps.py), as `jaxserve plan` compiles the steps."""
        place = jax.sharding.SingleDeviceSharding(device or self.device)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place), self._params)
        return self._encode.lower(shapes, jax.ShapeDtypeStruct((bucket, *self.image_shape), jnp.float32,
                                                               sharding=place))

    def _run(self, batch: np.ndarray) -> jax.Array:
        return self._encode(self._params, jax.device_put(batch, self.device))

    def encode(self, pixels: list[np.ndarray]) -> list[np.ndarray]:
        """Each image's rows [tokens per image, hidden], on the host."""
        out: list[np.ndarray] = []
        while len(out) < len(pixels):
            left = len(pixels) - len(out)
            bucket = next((b for b in self.buckets if b >= left), self.buckets[-1])
            batch = np.zeros((bucket, *self.image_shape), np.float32)
            taken = min(bucket, left)
            batch[:taken] = pixels[len(out):len(out) + taken]
            out.extend(np.asarray(self._run(batch))[:taken])
        return out

