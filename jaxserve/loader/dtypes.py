"""The dtypes weights can be served in, and what `--dtype auto` means on each platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
