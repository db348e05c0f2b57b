"""A request's limits that depend on the model and the engine's fixed sizes, checked before anything is
allocated: each failure is an `InvalidParameter` naming the parameter (a 400 from the server).

What passed them is a `CheckedRequest` (`Engine.check_request`), which `Engine.submit` queues as it is: a
caller that checks every prompt of a request before it queues any (the HTTP server) checks each once.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.config import ModelConfig, SamplerConfig, SchedulerConfig
from jaxserve.errors import InvalidParameter
from jaxserve.sampling.grammar import GrammarCompiler
from jaxserve.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class CheckedRequest:
    """A generation request that passed `validate_request` and `validate_priority`, its adapter read."""
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora: object | None = None  # `jaxserve.lora.manager.ActiveLoRA`; None: the base model
    images: tuple = ()  # its prompt's images (`scheduling/images.ImageSpan`), for a vision model's engine
    mrope: object = None  # its prompt's M-RoPE positions (`model/mrope.PromptPositions`), for Qwen-VL's engine


def validate_prompt(prompt_ids: Sequence[int], model: ModelConfig, scheduler: SchedulerConfig,
                    reserve: int = 1) -> None:
    """A prompt of known tokens that fits the context with `reserve` tokens to spare (1: a new token)."""
    if len(prompt_ids) == 0:
        raise InvalidParameter("prompt", "prompt is empty: it must contain at least one token")
    vocab = model.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise InvalidParameter("prompt", f"prompt contains token ids outside the vocabulary [0, {vocab})")
    limit = scheduler.max_model_len
    if len(prompt_ids) + reserve > limit:
        room = ": it must leave room for at least one new token" if reserve else ""
        raise InvalidParameter("prompt", f"prompt has {len(prompt_ids)} tokens but the model's context length "
                               f"(max_model_len) is {limit}{room}")


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, *, model: ModelConfig,
                     scheduler: SchedulerConfig, sampler: SamplerConfig, suppressed_ids: tuple[int, ...],
                     grammars: GrammarCompiler) -> None:
    """`suppressed_ids`: what min_tokens would mask for these params (EOS and stop tokens)."""
    if not isinstance(params, SamplingParams):
        raise InvalidParameter("sampling_params",
                               f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    validate_prompt(prompt_ids, model, scheduler)
    vocab = model.vocab_size
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidParameter(name, f"{name} must be token ids in [0, {vocab})")
    if params.top_k > vocab:
        raise InvalidParameter("top_k", f"top_k must be at most the vocabulary size {vocab} (or -1 / 0 "
                               f"for no limit), got {params.top_k}")
    most = sampler.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > most:
            raise InvalidParameter(name, f"{name} may be at most {most} (--max-logprobs)")
    entries = len(set(params.logit_bias or ()) | set(params.allowed_token_ids or ()))
    if params.min_tokens:
        entries += len(suppressed_ids)
    if entries > sampler.max_logit_bias:
        raise InvalidParameter("logit_bias" if params.logit_bias else "allowed_token_ids",
                               f"{entries} logit_bias / allowed_token_ids entries (with min_tokens: plus the "
                               f"EOS and stop tokens) exceed --max-logit-bias {sampler.max_logit_bias}")
    if params.n > scheduler.max_num_seqs:
        raise InvalidParameter("n", f"n may be at most --max-num-seqs ({scheduler.max_num_seqs})")
    if params.structured_outputs is not None:
        grammars.compile(params.structured_outputs)  # cached: cheap for a spec seen before


def validate_priority(priority: int, scheduler: SchedulerConfig) -> None:
    """A request's `priority` means something only under the priority policy (vLLM refuses it otherwise)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidParameter("priority", f"priority must be an integer, got {type(priority).__name__}")
    if priority != 0 and scheduler.scheduling_policy != "priority":
        raise InvalidParameter("priority", f"priority {priority} needs priority scheduling: start the engine "
                                           f"with --scheduling-policy priority")
