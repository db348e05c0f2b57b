"""Benchmarks keep working: each runs here on a tiny model. Timings are not asserted (shared, noisy
machines); what is checked is that the run completes, its own checks pass, and it reports what it should."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefix_cache_ttft_benchmark_runs_on_a_tiny_model(capsys):
    bench = load("prefix_cache_ttft")
    argv = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
            "--vocab", "512", "--system-tokens", "100", "--question-tokens", "8", "--rounds", "2",
            "--max-num-batched-tokens", "64"]
    assert bench.main(argv) == 0  # it asserts itself that warm requests hit and nothing recompiled
    out = capsys.readouterr().out
    assert "| cold (cache emptied) | 108 |" in out
    assert "| warm (system prompt cached) | 12 |" in out  # 96 of 108 tokens came from the cache
    assert "cold / warm TTFT ratio:" in out
    assert "Reproduce: ./dev run python benchmarks/prefix_cache_ttft.py --hidden 64" in out
