"""A completion or chat request's prompts to the engine requests that run them, each checked once.

1. Per prompt: the context-length check in OpenAI's words (prompt plus max_tokens; a max_tokens the
   request left out is the model's default, or what is left of the context, and shrinks to fit), then the
   request's settings as the engine's `SamplingParams` (`to_sampling_params`: the server's defaults, from
   the model's generation_config, fill what the request left out), with a seed from --seed when it gives
   none.
2. The engine checks each (`EngineClient.check`: token ids, top_k, logprob counts, logit_bias sizes, n,
   priority, the grammar of a structured output, the LoRA adapter) and returns what it will queue as it is.
   Every prompt is checked before any is queued, so a bad one queues nothing. Runs on a worker thread: a
   new grammar compiles here.
"""

from __future__ import annotations

import dataclasses

from jaxserve.errors import InvalidParameter
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.validation import CheckedRequest
from server.http.errors import APIError
from server.serving.context import ServingContext


def engine_requests(ctx: ServingContext, body, prompt_ids: list[list[int]], max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    reasoning_end: str | None = None) -> list[CheckedRequest]:
    """`body`: a CompletionRequest or ChatCompletionRequest. `max_tokens` None: the model's default, else up
    to the context length. `reasoning_end`: the reply thinks first, and an output constraint applies after
    this text. Raises APIError."""
    limit = ctx.model.max_model_len
    lora = ctx.model.adapter_for(body.model)
    checked = []
    for ids in prompt_ids:
        wanted = max_tokens if max_tokens is not None else ctx.options.sampling_defaults.get("max_tokens")
        wanted = wanted if wanted is not None else limit - len(ids)
        if len(ids) + wanted > limit:
            if max_tokens is None and len(ids) < limit:  # a default, not the client's: it shrinks to fit
                wanted = limit - len(ids)
            else:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(ids) + wanted} tokens ({len(ids)} in the prompt, {wanted} for "
                                    f"the completion). Reduce the prompt or max_tokens.",
                               param="max_tokens" if len(ids) < limit else "prompt", code="context_length_exceeded")
        try:
            params = body.to_sampling_params(wanted, logprobs, ctx.options.sampling_defaults)
            if prompt_logprobs is not None and params.prompt_logprobs is None:
                params = dataclasses.replace(params, prompt_logprobs=prompt_logprobs)
            if reasoning_end is not None and params.structured_outputs is not None:
                params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                    params.structured_outputs, reasoning_end=reasoning_end))
        except InvalidParameter as e:  # e.g. two fields that both constrain the output
            raise APIError(400, str(e), param=e.param) from None
        checked.append(ctx.engine.check(ids, _seeded(ctx, params), body.priority, lora))
    return checked


def _seeded(ctx: ServingContext, params: SamplingParams) -> SamplingParams:
    """A request without a seed gets the next one of the server's --seed sequence (unchanged without it)."""
    if ctx.seeds is None or params.seed is not None or params.temperature == 0:
        return params
    return dataclasses.replace(params, seed=ctx.seeds.getrandbits(63))
