"""Architecture registry, keyed by the `model_type` of a Hugging Face config.json."""

from __future__ import annotations

from jaxserve.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxserve.models.llama import LlamaForCausalLM

# Every supported type is a variant of one decoder; a new family adds a class and rows here.
MODEL_REGISTRY = {model_type: LlamaForCausalLM for model_type in SUPPORTED_MODEL_TYPES}


def model_class(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {config.model_type!r}; "
                         f"supported: {', '.join(sorted(MODEL_REGISTRY))}") from None
