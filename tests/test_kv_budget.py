"""KV memory budgeting: pages from bytes or a device-memory fraction, the refusal, the log, the CLI flags."""

import logging

import jax.numpy as jnp
import pytest

from jaxserve import Engine, EngineArgs
from jaxserve.execution import kv_budget
from jaxserve.entrypoints.args import add_engine_args, engine_args_from
from jaxserve.config import ModelConfig
from jaxserve.execution.kv_budget import page_bytes, resolve_kv_budget

# stories260K: 5 layers, 4 KV heads, head_dim 8, float32 -> 2 * 5 * 4 * 4 * 8 * 4 = 5120 bytes per page of 4
PAGE_BYTES = 5120


@pytest.fixture(scope="module")
def config(stories_dir):
    return ModelConfig.from_pretrained(stories_dir)


def budget(config, **kw):
    return resolve_kv_budget(config, jnp.float32, page_size=4, max_model_len=64, max_num_seqs=4, **kw)


def test_page_bytes(config):
    assert page_bytes(config, 4, jnp.float32) == PAGE_BYTES
    assert page_bytes(config, 16, jnp.bfloat16) == PAGE_BYTES * 4 // 2
    # int8 / fp8 pages: a byte per element plus a float32 scale per token and KV head, 2 * 5 * 4 * 4 * (8 + 4)
    assert page_bytes(config, 4, jnp.int8) == page_bytes(config, 4, jnp.float8_e4m3fn) == 1920


def test_quantized_pages_hold_more_tokens_in_the_same_memory(config):
    memory = PAGE_BYTES * 40
    pages = {dtype: resolve_kv_budget(config, dtype, page_size=4, max_model_len=64, max_num_seqs=4,
                                      kv_cache_memory=memory).num_pages for dtype in (jnp.float32, jnp.int8)}
    assert pages == {jnp.float32: 40, jnp.int8: memory // 1920}  # 106 pages: 2.7x the tokens


def test_kv_cache_dtype_flag(stories_dir):
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineArgs(kv_cache_dtype="fp16")


def test_kv_cache_memory_sizes_the_pool_and_matches_the_device_arrays(stories_dir, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.execution.kv_budget"):
        engine = Engine(EngineArgs(model=str(stories_dir), page_size=4, max_model_len=64,
                                   kv_cache_memory=PAGE_BYTES * 40 + 100))
    assert engine.cache_config.num_pages == 40
    assert engine.runner.kv_cache.num_bytes == 40 * PAGE_BYTES
    # Capacity in tokens and in full-context sequences: 39 usable pages of 4 = 156 tokens = 2.4 x 64.
    assert "39 pages x 4 tokens = 156 tokens" in caplog.text and "holds 2.4 full-context sequences" in caplog.text


def test_default_is_every_slot_at_full_context(config):
    assert budget(config).num_pages == 4 * 16 + 1


@pytest.mark.parametrize("too_small, just_enough, name", [
    # max_model_len 64 needs 16 pages of 4, plus the null page.
    (dict(kv_cache_memory=PAGE_BYTES * 17 - 1), dict(kv_cache_memory=PAGE_BYTES * 17), "kv_cache_memory"),
    (dict(num_pages=16), dict(num_pages=17), "num_pages"),
])
def test_pool_below_one_full_context_sequence_is_refused(config, too_small, just_enough, name):
    with pytest.raises(ValueError, match=f"{name}.*cannot hold even one full-context sequence"):
        budget(config, **too_small)
    assert budget(config, **just_enough).num_pages == 17


def test_memory_fraction_uses_free_device_memory_after_weights(config, monkeypatch):
    monkeypatch.setattr(kv_budget, "device_free_bytes", lambda: PAGE_BYTES * 200)
    assert budget(config, gpu_memory_utilization=0.5).num_pages == 100
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        budget(config, gpu_memory_utilization=0.05)  # 10 pages


def test_memory_fraction_without_device_statistics_falls_back_with_a_log_line(config, monkeypatch, caplog):
    monkeypatch.setattr(kv_budget, "device_free_bytes", lambda: None)  # what the CPU reports
    with caplog.at_level(logging.WARNING, logger="jaxserve.execution.kv_budget"):
        assert budget(config, gpu_memory_utilization=0.9).num_pages == 4 * 16 + 1
    assert "gpu_memory_utilization 0.90 ignored" in caplog.text and "--kv-cache-memory" in caplog.text


def test_device_free_bytes_reads_memory_stats():
    # The CPU reports no statistics (why the fallback above exists); GPUs and TPUs report bytes_limit.
    import jax
    free = kv_budget.device_free_bytes()
    if jax.default_backend() == "cpu":
        assert free is None
    else:
        assert free > 0


@pytest.mark.parametrize("kw, name", [
    (dict(kv_cache_memory=0), "kv_cache_memory"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization"),
    (dict(num_pages=1), "num_pages"),
    (dict(page_size=12), "page_size"),
])
def test_bad_budget_options_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        EngineArgs(**kw)


def test_num_pages_and_kv_cache_memory_are_exclusive(config):
    with pytest.raises(ValueError, match="give one of them"):
        budget(config, num_pages=100, kv_cache_memory=PAGE_BYTES * 100)


def test_cli_flags():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_args_from(parser.parse_args([]))
    assert defaults.enable_prefix_caching and defaults.kv_cache_memory is None
    args = engine_args_from(parser.parse_args(["--no-prefix-caching", "--kv-cache-memory", "1000000",
                                               "--gpu-memory-utilization", "0.8"]))
    assert not args.enable_prefix_caching
    assert args.kv_cache_memory == 1_000_000 and args.gpu_memory_utilization == 0.8
