"""The engine's intake of prompts to embed (`--runner pooling`, `jaxserve/pooling/`).

1. `check` validates a prompt against the model and its pooler before anything is allocated (a ValueError
   naming the parameter) and resolves its pooling; `submit` queues what `check` returned through the
   engine's inbox, without checking it again (`add` is both).
2. The engine's next `step` drains the inbox on its own thread; the request's `EmbeddingRequestOutput`
   comes out of a later `step` once its whole prompt has been through the steps.
The engine owns one `PoolingRequests` (`Engine.pooling`) whatever its runner: on a generating engine every
call is refused with `WrongRunner`, the error the server turns into a 400.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Sequence

from jaxserve.config import ModelConfig, SchedulerConfig
from jaxserve.errors import InvalidParameter, WrongRunner
from jaxserve.execution.heads.pool import pooled_request
from jaxserve.pooling.config import PoolerConfig
from jaxserve.pooling.params import PooledPrompt, PoolingParams
from jaxserve.scheduling.validation import validate_prompt


@dataclasses.dataclass(frozen=True)
class CheckedPooling:
    """A prompt to embed that passed `PoolingRequests.validate`, its pooling resolved (submit it once: the
    pooling gathers the request's result)."""
    prompt_ids: list[int]
    pooling: PooledPrompt


class PoolingRequests:
    def __init__(self, pooler_config: PoolerConfig | None, model_config: ModelConfig,
                 scheduler_config: SchedulerConfig, queue: Callable[[list], None]):
        """`pooler_config`: the model's pooling (None: the engine generates, and refuses embeddings);
        `queue(requests)` hands a checked request, as the scheduler runs it, to the engine's inbox."""
        self.pooler_config = pooler_config
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self._queue = queue

    def validate(self, prompt_ids: Sequence[int], params: PoolingParams) -> PooledPrompt:
        """Check a pooling request (a ValueError naming the parameter) and resolve it against the model's
        pooler; allocates nothing."""
        if self.pooler_config is None:
            raise WrongRunner("this model runs with the generate runner: embeddings need the pooling runner "
                              "(start it with --runner pooling)")
        if not isinstance(params, PoolingParams):
            raise InvalidParameter("pooling_params",
                                   f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        validate_prompt(prompt_ids, self.model_config, self.scheduler_config, reserve=0)
        return PooledPrompt.resolve(params, self.pooler_config)

    def check(self, prompt_ids: Sequence[int], params: PoolingParams) -> CheckedPooling:
        """`validate`, its result kept for `submit`, which queues it without checking again."""
        prompt_ids = [int(t) for t in prompt_ids]
        return CheckedPooling(prompt_ids, self.validate(prompt_ids, params))

    def submit(self, request: CheckedPooling, request_id: str | None = None, prompt: str | None = None) -> str:
        """Queue a checked pooling request (thread-safe): one `EmbeddingRequestOutput` comes out when its
        whole prompt has been through the steps. Returns the id."""
        request_id = request_id or uuid.uuid4().hex
        self._queue(pooled_request(request.prompt_ids, request.pooling, request_id, prompt))
        return request_id

    def add(self, prompt_ids: Sequence[int], params: PoolingParams | None = None, request_id: str | None = None,
            prompt: str | None = None) -> str:
        """Check and queue a pooling request (`check`, then `submit`). Returns the id."""
        return self.submit(self.check(prompt_ids, params or PoolingParams()), request_id, prompt)
