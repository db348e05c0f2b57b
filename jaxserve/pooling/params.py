"""A pooling request's settings, its running sum on the host, and what it hands back (vLLM's shapes).

1. `PoolingParams` (vLLM's name): `dimensions` (Matryoshka) and `normalize`; jaxserve also lets an
   offline caller pick the `pooling_type` per request (the model's, by default).
2. `PooledPrompt` gathers the rows the steps pool for one request: the row of the chunk that holds the
   wanted token (last or first), or the sum over every chunk (mean). `finish` makes the vector.
3. `EmbeddingRequestOutput` is what `LLM.embed` and the server get: the vector and the prompt's tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.errors import InvalidParameter
from jaxserve.pooling.config import CLS, LAST, MEAN, POOLING_TYPES, PoolerConfig


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # cut the vector to this size (Matryoshka models only), before normalizing
    normalize: bool | None = None  # None: as the model's pooler config says
    pooling_type: str | None = None  # LAST | MEAN | CLS; None: the model's

    def __post_init__(self):
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidParameter("pooling_type", f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                                   f"got {self.pooling_type!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParameter("normalize", f"normalize must be true or false, got {self.normalize!r}")


@dataclasses.dataclass(eq=False)
class PooledPrompt:
    """One request's pooling, resolved against the model's config, and its partial result."""
    kind: int  # LAST, MEAN or CLS
    normalize: bool
    dimensions: int | None
    total: np.ndarray | None = None  # [hidden] float32: the picked row, or the running sum (mean)

    @classmethod
    def resolve(cls, params: PoolingParams, config: PoolerConfig) -> PooledPrompt:
        config.check_dimensions(params.dimensions)
        kind = POOLING_TYPES[params.pooling_type or config.pooling_type]
        normalize = config.normalize if params.normalize is None else params.normalize
        return cls(kind, normalize, params.dimensions)

    @property
    def setting(self) -> int:
        """What the pool head's batch field gets for each of the request's spans (`PoolBatch.kind`)."""
        return self.kind

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states of the prompt's start: no prefix-cache hits for them."""
        return self.kind != LAST

    def add(self, row: np.ndarray, first_chunk: bool, start: int, last_chunk: bool) -> None:
        """Fold in the row a step pooled for one chunk of the prompt (positions start..)."""
        if first_chunk:  # a fresh admission (or a recomputation after preemption) starts over
            self.total = None
        if self.kind == MEAN:
            self.total = row.copy() if self.total is None else self.total + row
        elif (self.kind == LAST and last_chunk) or (self.kind == CLS and start == 0):
            self.total = row.copy()

    def finish(self, num_tokens: int) -> np.ndarray:
        vector = self.total / num_tokens if self.kind == MEAN else self.total
        if self.dimensions is not None:
            vector = vector[:self.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32)


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """One finished pooling request (`finished` is always True: an embedding comes whole)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    queue_seconds: float | None = None
    num_cached_tokens: int = 0
    finish_reason: str = "stop"  # as a generated choice's, for the request metrics
    num_output_tokens: int = 0

    @property
    def embedding(self) -> list[float]:
        return self.outputs.embedding
