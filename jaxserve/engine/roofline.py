"""Roofline floors of a serving step: the least time a chip's HBM bandwidth and peak FLOP/s allow.

1. `StepWork.of(params, config, ...)` reads what one device holds from the model's parameters (arrays or
   shapes, each with its sharding, so tensor and expert parallelism are counted as they are laid out):
   the bytes a step streams and the FLOPs a token costs on that device. A mixture's experts count by the
   share of them a step's tokens route to: n tokens choosing k of E experts touch E * (1 - (1 - k / E)^n)
   of them in expectation, so one sequence reads k / E of the expert weights and a large batch nearly all.
   An untied embedding table is gathered (a row a token), not streamed; a tied one is the LM head too.
2. `decode_step_seconds(n)`: n sequences decoding one token each at `context` tokens of KV: the larger of
   bytes / bandwidth (weights + every sequence's KV) and FLOPs / peak, on each pipeline stage in turn.
3. `prefill_tokens_per_second()`: compute-bound, every stage busy on its own microbatch.
A floor is what no kernel can beat; measured steps sit above it (docs/performance.md says by how much).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.loader.tree import flatten
from jaxserve.quantization.weights import device_bytes
from sharding.chips import Chip


@dataclasses.dataclass(frozen=True)
class StepWork:
    dense_bytes: int  # per device: weights every step streams whole
    expert_bytes: int  # per device: the experts' weights (a step reads the share its tokens route to)
    matmul_params: int  # per device: weights a token multiplies by (experts at k / E), for FLOPs
    kv_bytes_per_token: int  # per device: one cached token's K and V in every layer it holds
    attention_width: int  # per device: layers x query heads x head_dim, for the attention FLOPs
    expert_share: tuple[int, int]  # (k, E): experts chosen per token, experts in all; (0, 0) dense
    pipeline_stages: int
    chip: Chip

    @classmethod
    def of(cls, params, config: ModelConfig, chip: Chip, kv_bytes_per_token: int, layers_per_device: int,
           heads_per_device: int, pipeline_stages: int) -> "StepWork":
        dense = experts = matmul = 0
        k, e = config.num_experts_per_tok, config.num_experts
        for path, leaf in flatten(_pure(params)):
            name = "/".join(map(str, path))
            shard = jax.ShapeDtypeStruct(leaf.sharding.shard_shape(leaf.shape), leaf.dtype)
            size = device_bytes(shard)
            if "experts" in name:
                experts += size
                matmul += shard.size * k // max(e, 1)
            elif name.startswith("embed_tokens") and not config.tie_word_embeddings:
                continue  # gathered a row a token
            else:
                dense += size
                matmul += shard.size if leaf.ndim >= 2 else 0
        return cls(dense, experts, matmul, kv_bytes_per_token, layers_per_device * heads_per_device * config.head_dim,
                   (k, e) if e else (0, 0), pipeline_stages, chip)

    def expert_fraction(self, tokens: int) -> float:
        k, e = self.expert_share
        return 0.0 if not e else 1 - (1 - k / e) ** tokens

    def decode_step_seconds(self, sequences: int, context: int) -> float:
        weights = self.dense_bytes + self.expert_bytes * self.expert_fraction(sequences)
        streamed = weights + sequences * context * self.kv_bytes_per_token
        flops = sequences * (2 * self.matmul_params + 4 * context * self.attention_width)
        stage = max(streamed / self.chip.hbm_bandwidth, flops / self.chip.bf16_flops)
        return self.pipeline_stages * stage  # one token passes every stage in turn

    def prefill_tokens_per_second(self, context: int) -> float:
        """Tokens a second a long prefill can reach, attention at half of `context` on average."""
        flops_per_token = 2 * self.matmul_params + 4 * (context / 2) * self.attention_width
        return self.chip.bf16_flops / flops_per_token


def _pure(params):
    """An nnx.State or a plain nested dict, as a nested dict of its leaves."""
    return nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
