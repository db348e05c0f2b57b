"""Architecture registry, keyed by the `model_type` of a Hugging Face config.json.

`model_class` picks the NNX module of a config; `abstract_model` builds it as shapes only (every
parameter's path, shape and dtype, no memory; quantized linear layers where the config says), which is
what loading plans from; `random_model` builds it with deterministic random float weights (the random
demo model, tests, benchmarks), which `--quantization` then quantizes as it loads them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxserve.model.feature_major import feature_major_linears
from jaxserve.model.gemma import GemmaForCausalLM
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.moe import MoEForCausalLM
from jaxserve.model.quantized_linear import quantize_linears

# The Llama family's types are variants of one decoder; a new family adds a class and rows here.
MODEL_REGISTRY = {model_type: LlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES}
MODEL_REGISTRY.update(gemma2=GemmaForCausalLM, gemma3_text=GemmaForCausalLM, qwen3_moe=MoEForCausalLM,
                      mixtral=MoEForCausalLM)


def model_class(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {config.model_type!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None


def abstract_model(config: ModelConfig, dtype, feature_major: bool = False) -> nnx.Module:
    """The model as shapes and dtypes only (`nnx.eval_shape`: no memory, no random init); with
    `config.linear_quantization`, its decoder layers' linear layers are quantized ones; `feature_major`: its
    linear layers turned as a CPU runs them (jaxserve/model/feature_major.py)."""
    cls = model_class(config)

    def build():
        model = cls(config, dtype=dtype, rngs=nnx.Rngs(0))
        if config.linear_quantization is not None:
            model = quantize_linears(model, config.linear_quantization)
        return feature_major_linears(model) if feature_major else model

    return nnx.eval_shape(build)


def random_model(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> nnx.Module:
    """Randomly initialised weights (deterministic in `seed`), for the random demo model and tests."""
    return model_class(config)(config, dtype=dtype, rngs=nnx.Rngs(seed))
