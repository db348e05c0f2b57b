"""A request's sampling settings, validated once on the host (no JAX here).

1. `SamplingParams` holds a request's settings in vLLM's names and meanings and checks them on creation
   (an `InvalidParameter` naming the parameter); limits that depend on the model (vocabulary, the
   engine's fixed sizes) are checked by `jaxserve/scheduling/validation.py`.
2. The batch builder copies each sequence's settings into the step's per-row arrays
   (`jaxserve/sampling/sampler.py`), so any mix of settings runs the same compiled program.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Sequence

from jaxserve.errors import InvalidParameter
from jaxserve.sampling.grammar import StructuredOutputsParams

__all__ = ["ADD_BIAS", "ALLOWED", "BiasTable", "InvalidParameter", "SamplingParams", "bias_table", "seed_words"]

# Bits of an entry kind in a row's bias list (see `bias_table` and jaxserve/sampling/logits.py).
ADD_BIAS, ALLOWED = 1, 2
# A request's static bias entries: (token ids, values, kinds), one entry per token.
BiasTable = tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]

@dataclasses.dataclass
class SamplingParams:
    """A request's generation settings, in vLLM's names and with vLLM's meanings."""
    n: int = 1  # independent choices for the prompt (they share its prefill)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: Sequence[int] | None = None  # only these may be drawn
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are out
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] | str | None = None  # stop strings (not in the output unless included, below)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # per sampled token: its logprob and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Requests share cached prefix pages only with requests of the same salt (None shares with None):
    # a tenant's salt keeps others from timing its prompts through cache hits.
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidParameter(name, f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InvalidParameter("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParameter("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise InvalidParameter("top_k", f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParameter("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InvalidParameter("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidParameter("n", f"n must be a positive integer, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidParameter(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise InvalidParameter("repetition_penalty",
                                   f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidParameter("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                   f"({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidParameter(name, f"{name} must be a non-negative integer, got {value!r}")
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise InvalidParameter("logit_bias", "logit_bias must map token ids to numbers") from None
            if any(not (math.isfinite(v) and -100 <= v <= 100) for v in self.logit_bias.values()):
                raise InvalidParameter("logit_bias", "logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
            if not self.allowed_token_ids:
                raise InvalidParameter("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise InvalidParameter("seed", f"seed must be a 64-bit integer (signed or unsigned), got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidParameter("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidParameter("cache_salt",
                                   f"cache_salt must be a non-empty string when given, got {self.cache_salt!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the step must change this request's logits before drawing (penalties, biases, masks)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens)

    def resolved_seed(self) -> int:
        """The seed to draw with: the request's, or a fresh random one (unseeded requests differ)."""
        return self.seed if self.seed is not None else secrets.randbits(63)


def seed_words(seed: int) -> tuple[int, int]:
    """The seed's 64 bits as (high, low) 32-bit words; a negative seed counts as its two's complement."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def bias_table(params: SamplingParams) -> BiasTable:
    """A request's static bias entries: its logit_bias (ADD_BIAS) and allowed_token_ids (ALLOWED), merged
    per token. The min_tokens masking of EOS and stop tokens is added per draw by the batch builder."""
    entries: dict[int, list] = {t: [v, ADD_BIAS] for t, v in (params.logit_bias or {}).items()}
    for t in params.allowed_token_ids or ():
        entries.setdefault(t, [0.0, 0])[1] |= ALLOWED
    return tuple(entries), tuple(e[0] for e in entries.values()), tuple(e[1] for e in entries.values())
