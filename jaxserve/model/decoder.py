"""The skeleton every decoder family shares: embedding, a list of layers, final norm, LM head unless tied.

Families differ in their layer and norm classes (`gemma.py`, `moe.py`); `LlamaForCausalLM` supplies the
forward pieces (`embed`, `rope`, `run_layers`, `logits`) they inherit.
"""

from __future__ import annotations

from typing import Callable

from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.model.llama import _linear


def init_decoder(model: nnx.Module, config: ModelConfig, dtype, rngs: nnx.Rngs, layer: Callable,
                 norm: Callable) -> None:
    """Give `model` its parameters; `layer(config, index, dtype, rngs)` builds layer `index`."""
    c = config
    model.config = config
    model.embed_tokens = nnx.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
    model.layers = nnx.List([layer(c, i, dtype, rngs) for i in range(c.num_layers)])
    model.norm = norm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
    if not c.tie_word_embeddings:
        model.lm_head = _linear(dtype, c.hidden_size, c.vocab_size, False, rngs)
