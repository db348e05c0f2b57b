"""Speculative decoding's counters in /metrics under vLLM's names, from an engine's stats (no model), and
`--speculative-config` on the command line."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.precision import Precision
from jaxserve.entrypoints.args import engine_args_from
from jaxserve.entrypoints.cli import build_parser
from jaxserve.scheduling.stats import EngineStats
from jaxserve.scheduling.step_cost import StepCostModel
from jaxserve.speculative.ngram import NgramProposer
from jaxserve.speculative.payoff import OUTCOMES
from jaxserve.speculative.speculator import Speculator
from server.serving.metrics import Metrics


def fake_async_engine(speculator):
    stats = EngineStats()
    stats.count_drafts(3, 2)
    stats.count_drafts(3, 0)
    scheduler = SimpleNamespace(running=[], waiting=[], kv_usage=lambda: 0.0, num_preemptions=0,
                                prefix_cache_queries=0, prefix_cache_hits=0)
    engine = SimpleNamespace(model_name="m", scheduler=scheduler, stats=stats, compilations_since_warmup=0,
                             startup_seconds={}, runner=SimpleNamespace(ready_buckets=(8,), layouts={8: None}),
                             speculator=speculator, lora=None,
                             precision=Precision("float32", None, None, None, 4096, "float32", 1024, 64, "blocked (jnp)"))
    ready = threading.Event()
    ready.set()
    return SimpleNamespace(engine=engine, ready=ready)


def scrape(async_engine) -> dict:
    text = generate_latest(Metrics(async_engine).registry).decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_spec_decode_counters_appear_under_vllms_names():
    speculator = Speculator(SpeculativeConfig("ngram", 3), NgramProposer(3, 1, 2), StepCostModel((8,)))
    speculator.outcomes.update(drafting=5, unprofitable=3, probe=1)
    samples = scrape(fake_async_engine(speculator))
    engine_labels = [("engine", "0"), ("model_name", "m")]
    assert samples["vllm:spec_decode_num_drafts_total" + str(engine_labels)] == 2
    assert samples["vllm:spec_decode_num_draft_tokens_total" + str(engine_labels)] == 6
    assert samples["vllm:spec_decode_num_accepted_tokens_total" + str(engine_labels)] == 2
    per_pos = [samples["vllm:spec_decode_num_accepted_tokens_per_pos_total"
                       + str(sorted([*engine_labels, ("position", str(p))]))] for p in range(3)]
    assert per_pos == [1, 1, 0]
    assert samples["jaxserve:spec_decode_num_drafts_total[]"] == 2
    assert "jaxserve:spec_decode_proposer_seconds_total[('phase', 'propose')]" in samples
    # How often drafting was on, and why it was off: every outcome, zero where none happened.
    steps = {outcome: samples[f"jaxserve:spec_decode_steps_total[('outcome', '{outcome}')]"] for outcome in OUTCOMES}
    assert steps == {"drafting": 5, "probe": 1, "unprofitable": 3, "no_drafts": 0, "measuring": 0, "batch_size": 0}


def test_no_spec_decode_series_without_speculation():
    assert not any("spec_decode" in name for name in scrape(fake_async_engine(None)))


def test_the_cli_takes_vllms_json():
    parser = build_parser()
    ns = parser.parse_args(["serve", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'])
    config = engine_args_from(ns).speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min) == ("ngram", 3, 2)
    ns = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_args_from(ns)
