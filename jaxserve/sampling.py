"""Sampling: request parameters on the host, one vectorised sampler on device.

1. `SamplingParams` validates a request's settings once (a `ValueError` naming the parameter); limits
   that depend on the model (vocabulary, the engine's fixed sizes) are checked by `Engine.validate`.
2. The runner packs every slot's settings into `SamplingArrays` (fixed [max_slots] arrays), so any mix
   of greedy and sampled requests runs the same compiled program.
3. `sample` applies temperature, top-k, top-p and min-p per row and draws with a key derived from the
   request's seed and the index of the token being drawn — so a seeded request gives the same tokens
   whatever else shares the batch, and rows with temperature 0 take the argmax.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxserve.errors import InvalidParameter
from jaxserve.structured import StructuredOutputsParams

__all__ = ["InvalidParameter", "SamplingParams", "SamplingArrays", "sample", "greedy", "seed_words"]


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    temperature: jax.Array  # [slots] float32; 0 = greedy
    top_k: jax.Array  # [slots] int32; 0 = off
    top_p: jax.Array  # [slots] float32
    min_p: jax.Array  # [slots] float32
    seed: jax.Array  # [slots, 2] uint32: the request seed's high and low 32 bits
    step: jax.Array  # [slots] int32: index of the token being drawn within its request


def seed_words(seed: int) -> tuple[int, int]:
    """The seed's 64 bits as (high, low) 32-bit words; a negative seed counts as its two's complement."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def greedy(logits: jax.Array) -> jax.Array:
    """Row-wise argmax (first index of the maximum), [rows, vocab] -> [rows] int32.

    Two plain reductions rather than `jnp.argmax`: XLA's CPU backend runs argmax's (value, index) pair
    reduction about ten times slower, and on CPU it was a tenth of a batched decode step."""
    vocab = logits.shape[-1]
    top = logits.max(axis=-1, keepdims=True)
    index = jnp.min(jnp.where(logits == top, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(index, vocab - 1)  # a NaN row matches nothing: answer a valid id, not vocab


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """logits [slots, vocab] float32 -> token ids [slots] int32."""
    greedy_tokens = greedy(logits)
    # The sort below costs a vocab-sized sort per row: skip it when every row is greedy.
    return jax.lax.cond(jnp.any(params.temperature > 0),
                        lambda: jnp.where(params.temperature > 0, _sample_filtered(logits, params), greedy_tokens),
                        lambda: greedy_tokens)


def _sample_filtered(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    # The filters cost a vocab-sized sort per row: skip it when no row sets one (vLLM's defaults). A row
    # without filters keeps every token on either branch, so what its neighbours ask never changes its draw.
    filtering = (params.top_k > 0) | (params.top_p < 1) | (params.min_p > 0)
    keep = jax.lax.cond(jnp.any(filtering), lambda: _kept_by_filters(scaled, params),
                        lambda: jnp.ones(scaled.shape, jnp.bool_))
    masked = jnp.where(keep | ~filtering[:, None], scaled, -jnp.inf)

    def draw(seed, step, row):
        key = jax.random.fold_in(jax.random.wrap_key_data(seed, impl="threefry2x32"), step)
        return jax.random.categorical(key, row)

    return jax.vmap(draw)(params.seed, params.step, masked).astype(jnp.int32)


def _kept_by_filters(scaled: jax.Array, params: SamplingArrays) -> jax.Array:
    """[rows, vocab] bool: the tokens top-k, top-p and min-p keep, in token order."""
    vocab = scaled.shape[-1]
    # One descending sort serves top-k, top-p and min-p.
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is short.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < params.top_p[:, None]
    keep &= probs >= params.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)  # the most likely token always survives
    # Back in token order before the draw: the noise each token gets must follow its id, not its rank. By
    # rank, two near-equal logits that swap places (rounding differs between batch shapes) would swap
    # noise, and a seeded request would draw differently depending on what shares its batch.
    rows = jnp.arange(scaled.shape[0])[:, None]
    return jnp.zeros_like(keep).at[rows, order].set(keep)
