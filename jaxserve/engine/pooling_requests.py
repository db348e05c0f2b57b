"""The pooling runner's requests (`--runner pooling`, `jaxserve/pooling/`), as the engine takes them.

A prompt to embed is checked against the model and its pooler before anything is allocated
(`check_pooling`), then queued through the engine's inbox like a generation request (`submit_pooling`); its
`EmbeddingRequestOutput` comes out of `step` once the whole prompt has been through the steps.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Sequence

from jaxserve.errors import InvalidParameter, WrongRunner
from jaxserve.pooling.params import PooledPrompt, PoolingParams
from jaxserve.scheduling.validation import validate_prompt


@dataclasses.dataclass(frozen=True)
class CheckedPooling:
    """A prompt to embed that passed `validate_pooling`, its pooling resolved (submit it once: the pooling
    gathers the request's result)."""
    prompt_ids: list[int]
    pooling: PooledPrompt


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
        """Check and queue a pooling request (`check_pooling`, then `submit_pooling`). Returns the id."""
        return self.submit_pooling(self.check_pooling(prompt_ids, params or PoolingParams()), request_id, prompt)

    def check_pooling(self, prompt_ids: Sequence[int], params: PoolingParams) -> CheckedPooling:
        """`validate_pooling`, its result kept for `submit_pooling`, which queues it without checking again."""
        prompt_ids = [int(t) for t in prompt_ids]
        return CheckedPooling(prompt_ids, self.validate_pooling(prompt_ids, params))

    def submit_pooling(self, request: CheckedPooling, request_id: str | None = None, prompt: str | None = None) -> str:
        """Queue a checked pooling request (thread-safe): one `EmbeddingRequestOutput` comes out when its
        whole prompt has been through the steps. Returns the id."""
        request_id = request_id or uuid.uuid4().hex
        self._inbox.put(("add", self.tracker.new_pooling_request(request.prompt_ids, request.pooling, request_id,
                                                                 prompt)))
        return request_id
