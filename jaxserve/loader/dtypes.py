"""The dtypes weights can be served in, and what `--dtype auto` means on each platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# 4-bit codes are stored one per byte by the converted formats (safetensors has no 4-bit type, Orbax's
# TensorStore no uint4) and narrowed again as they are read.
STORED_AS = {np.dtype(jnp.int4): np.dtype(np.int8), np.dtype(jnp.uint4): np.dtype(np.uint8)}


def stored_dtype(dtype) -> np.dtype:
    """The dtype a converted checkpoint stores a parameter of `dtype` in."""
    return STORED_AS.get(np.dtype(dtype), np.dtype(dtype))


def resolve_dtype(requested: str, config: ModelConfig, platform: str | None = None):
    """`auto` follows the checkpoint on accelerators; on CPU it uses float32 (bf16 matmuls crawl there)."""
    if requested == "auto":
        platform = platform or jax.default_backend()
        if platform == "cpu":
            return jnp.float32
        return DTYPES.get(str(config.torch_dtype).removeprefix("torch."), jnp.bfloat16)
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {requested!r}")
    return DTYPES[requested]
