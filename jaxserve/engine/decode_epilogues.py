"""Whether a GPU engine's decode steps split their products and fuse the epilogues (issue 52).

Chosen once at start, after the quantized products' kernels (a layer given a Pallas product keeps it, and
its model the plain layers): `DecodeEpilogues` goes on the model as a static attribute, so the step
programs compiled at warm-up embed it and the program cache keys them by it (jaxserve/model/split_k.py).
Only GPUs take it, and only a Llama-family model run unrolled whose every layer's o_proj and down_proj the
split takes (float, or int8 / fp8 weight-only per channel, no bias; q/k/v too where they qualify, with float
pages, checked as a step is traced); CPU and TPU programs stay as they were.
"""

from __future__ import annotations

import dataclasses
import logging

from flax import nnx

from jaxserve.loader.placement import ShardedModel
from jaxserve.model.llama import DecoderLayer, LlamaForCausalLM
from jaxserve.model.split_k import DecodeEpilogues, takes_qkv

logger = logging.getLogger(__name__)


def choose_decode_epilogues(model: ShardedModel, platform: str, interpret: bool = False) -> ShardedModel:
    """`model` with `DecodeEpilogues` set where it applies (see the module docstring); `interpret`: the
    kernels in interpret mode (tests forcing the GPU path on a CPU)."""
    if platform not in ("gpu", "cuda") and not interpret:
        return model
    module = nnx.merge(model.graphdef, model.params)
    layers = list(getattr(module, "layers", ()))
    if (type(module) is not LlamaForCausalLM or model.layer_repeats > 1 or not layers
            or not all(type(layer) is DecoderLayer and layer.takes_split() for layer in layers)):
        return model
    module.decode_epilogues = DecodeEpilogues(interpret=interpret)
    qkv = all(takes_qkv(layer.self_attn) for layer in layers)
    logger.info("decode steps of up to %d rows: %s split along K, each product with one epilogue kernel",
                module.decode_epilogues.max_rows, "q/k/v, o_proj and down_proj" if qkv else "o_proj and down_proj")
    graphdef, params = nnx.split(module)
    return dataclasses.replace(model, graphdef=graphdef, params=params)
