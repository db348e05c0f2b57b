"""The speculator an engine's `--speculative-config` asks for (None without one)."""

from __future__ import annotations

import logging

from jaxserve.config import SpeculativeConfig
from jaxserve.speculative.ngram import NgramProposer
from jaxserve.speculative.speculator import Speculator

logger = logging.getLogger(__name__)


def target_programs(config: SpeculativeConfig | None) -> dict:
    """The target's step programs under `config` (`ModelRunner`'s arguments): the draft tokens a sequence may
    verify per step, and whether the steps that verify none run a plain program of their own (prompt lookup;
    beside a draft model, whose own programs follow each of the target's, a bucket keeps one program)."""
    if config is None:
        return {}
    return {"max_drafts": config.num_speculative_tokens, "plain_programs": config.method == "ngram"}


def build_speculator(config: SpeculativeConfig | None, built, runner, scheduler) -> Speculator | None:
    """`built`: the target's `BuiltModel`; `runner`: its model runner (a draft model shares its mesh);
    `scheduler`: told to hold pages ahead for a draft model's own K/V."""
    if config is None:
        return None
    if getattr(built, "runner", "generate") == "pooling":
        raise ValueError("speculative_config: the pooling runner draws no tokens to speculate on")
    if config.method == "ngram":
        proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        detail = f"prompt lookup {config.prompt_lookup_min}..{config.prompt_lookup_max} tokens"
    else:
        from jaxserve.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer.build(config, built, runner)
        scheduler.lookahead = config.num_speculative_tokens
        detail = f"draft model {proposer.name}"
    logger.info("speculative decoding: %s, %d draft tokens per step, %s", config.method,
                config.num_speculative_tokens, detail +
                (f", off above {config.disable_by_batch_size} running sequences" if config.disable_by_batch_size else "")
                + (", drafting where its expected gain pays for its measured cost"
                   if config.adaptive_drafting else ""))
    return Speculator(config, proposer, scheduler.step_cost)
