"""The pooling runner's requests (`--runner pooling`, `jaxserve/pooling/`), as the engine takes them.

A prompt to embed is checked against the model and its pooler before anything is allocated, then queued
through the engine's inbox like a generation request; its `EmbeddingRequestOutput` comes out of `step`
once the whole prompt has been through the steps.
"""

from __future__ import annotations

import uuid
from typing import Sequence

from jaxserve.errors import InvalidParameter, WrongRunner
from jaxserve.pooling.params import PooledPrompt, PoolingParams
from jaxserve.scheduling.validation import validate_prompt


class PoolingRequests:
    """Mixed into `Engine`, whose runner_type, model_config, scheduler_config, pooler_config, tracker and
    inbox it uses."""

    def validate_pooling(self, prompt_ids: Sequence[int], params: PoolingParams) -> PooledPrompt:
        """Check a pooling request (a ValueError naming the parameter) and resolve it against the model's
        pooler; allocates nothing."""
        if self.runner_type != "pooling":
            raise WrongRunner("this model runs with the generate runner: embeddings need the pooling runner "
                              "(start it with --runner pooling)")
        if not isinstance(params, PoolingParams):
            raise InvalidParameter("pooling_params",
                                   f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        validate_prompt(prompt_ids, self.model_config, self.scheduler_config, reserve=0)
        return PooledPrompt.resolve(params, self.pooler_config)

    def add_pooling_request(self, prompt_ids: Sequence[int], params: PoolingParams | None = None,
                            request_id: str | None = None, prompt: str | None = None) -> str:
        """Validate and queue a pooling request (thread-safe): one `EmbeddingRequestOutput` comes out when
        its whole prompt has been through the steps. Returns the id."""
        prompt_ids = [int(t) for t in prompt_ids]
        pooling = self.validate_pooling(prompt_ids, params or PoolingParams())
        request_id = request_id or uuid.uuid4().hex
        self._inbox.put(("add", self.tracker.new_pooling_request(prompt_ids, pooling, request_id, prompt)))
        return request_id
