"""`jaxserve plan MODEL --target T`: will it fit on a slice that is not here, and how fast can it be.

1. Public models' config.json (tests/fixtures/configs) planned for TPU slices and GPUs without compiling
   (`--programs none`: the fit and the advice are arithmetic over the abstract model): per-device weight bytes
   against the published parameter count, fit or not where the margin is clear, and every change the advice
   names makes the plan fit when applied.
2. A tiny model compiled for an H200 and a v6e: the JSON contract (`programs_compiled`, the per-device keys,
   the roofline) and the text report.
3. The KV pool a served engine gets from --gpu-memory-utilization is the one plan computes for the same free
   memory: both go through `kv_budget.resolve_kv_budget`.
4. Errors name what to change: an unknown target, fp8 pages on an A100, compilers not installed.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.entrypoints.cli import main
from tests.compile_targets import tiny_config, write_config

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
PARAMETERS = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "qwen3-30b-a3b": 30_532_122_624,
              "gemma-2-27b": 27_227_128_320}


def plan(capsys, *argv) -> tuple[int, dict]:
    code = main(["plan", *map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("model, target, fits", [
    ("llama-3-8b", "v6e-1", True), ("llama-3-8b", "h100", True), ("llama-3-70b", "h100", False),
    ("llama-3-70b", "h100x8", True), ("llama-3-70b", "v6e-8", True), ("llama-3-70b", "v5e-16", True),
    ("gemma-2-27b", "h100", False), ("qwen3-30b-a3b", "h100x2", True),
])
def test_public_models_fit_where_the_margin_is_clear(capsys, model, target, fits):
    code, r = plan(capsys, CONFIGS / model, "--target", target, "--programs", "none")
    assert (code, r["fits"]) == ((0, True) if fits else (1, False))
    d = r["per_device"]
    # bf16 weights split over the chips: the published count, within what padding and replicas add
    assert d["weights_bytes"] * r["devices"] == pytest.approx(2 * PARAMETERS[model], rel=0.02)
    assert d["hbm_bytes"] > d["limit_bytes"] > 0 if target.startswith("h") else d["hbm_bytes"] == d["limit_bytes"]
    assert (d["total_bytes"] <= d["limit_bytes"]) == fits
    assert bool(r["advice"]) != fits


@pytest.mark.parametrize("model, target, advised", [
    ("llama-3-70b", "h100", ["--target h100x4"]),  # 141 GB of weights: only more chips
    ("gemma-2-27b", "h100", ["--target h100x2", "--quantization int8", "--max-model-len", "--max-num-seqs"]),
])
def test_every_advised_change_makes_it_fit(capsys, model, target, advised):
    _, r = plan(capsys, CONFIGS / model, "--target", target, "--programs", "none")
    flags = [a["flags"] for a in r["advice"]]
    assert [f for f, want in zip(flags, advised) if f.startswith(want)] == flags
    for change in flags:
        argv = ["--target", target, *shlex.split(change)]  # a later --target wins
        code, after = plan(capsys, CONFIGS / model, *argv, "--programs", "none")
        assert (code, after["fits"]) == (0, True), change


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_config(tmp_path_factory.mktemp("tiny") / "tiny-llama", tiny_config("llama"))


@pytest.mark.parametrize("target", ["h200", "v6e-1"])
def test_json_contract_with_a_compiled_program(capsys, tiny, target):
    code, r = plan(capsys, tiny, "--target", target, "--max-num-seqs", "4", "--max-model-len", "512",
                   "--programs", "decode")
    assert code == 0 and r["fits"] and r["target"] == target and r["devices"] == 1
    assert r["programs_compiled"] == 1
    assert ("libtpu" if target.startswith("v") else "ptxas") in r["compiler"]
    d = r["per_device"]
    for key in ("weights_bytes", "kv_bytes_per_token", "kv_capacity_tokens", "program_temp_bytes_max", "hbm_bytes"):
        assert isinstance(d[key], int) and d[key] >= 0, key
    # 2 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes
    assert d["kv_bytes_per_token"] == 2 * 4 * 128 * 2 * 2
    program, = d["programs"]
    assert program["alias_bytes"] >= d["kv_pool_bytes"]
    roof = r["roofline"]
    assert set(roof["decode_step_s"]) == {"1", "4"} and roof["prefill_tok_s"] > 0
    assert 0 < roof["decode_step_s"]["1"] <= roof["decode_step_s"]["4"]


def test_text_report_and_no_fit_exit_status(capsys):
    code = main(["plan", str(CONFIGS / "llama-3-8b"), "--target", "v5e-1", "--programs", "none"])
    text = capsys.readouterr().out
    assert code == 1
    # 16.1 GB of weights and 8.6 GB of pages (8 sequences of 8192 tokens) on a 17.2 GB chip: 4 chips fit
    assert "does NOT fit" in text and "--target v5e-4" in text and "roofline floors" in text
    assert "weights          16.06 GB" in text and "--max-model-len 1056" in text


def test_serving_sizes_the_pool_as_plan_does(capsys, stories_dir, monkeypatch):
    """The pool a served engine gets from --gpu-memory-utilization, for the memory its devices report, is the
    pool plan computes from the chip's memory less the weights: the same function decides both."""
    import jax

    from jaxserve import EngineArgs
    from jaxserve.engine.builder import build_abstract, build_model, bytes_per_device
    from jaxserve.execution import kv_budget

    args = EngineArgs(model=str(stories_dir), gpu_memory_utilization=0.5, page_size=4, max_model_len=64)
    limit = 10_000_000
    planned = build_abstract(args, jax.devices(), "cpu", limit)
    weights = bytes_per_device(planned.model.params)
    monkeypatch.setattr(kv_budget, "device_free_bytes", lambda: limit - weights)  # what a chip would report
    served = build_model(args)
    assert served.cache_config.num_pages == planned.cache_config.num_pages == (limit - weights) // 2 // 5120


def test_errors_name_what_to_change(capsys, tiny):
    with pytest.raises(SystemExit) as e:
        main(["plan", str(tiny), "--target", "v7-8"])
    assert e.value.code == 2 and "v5e-N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(tiny), "--target", "a100", "--kv-cache-dtype", "fp8", "--programs", "none"])
    assert "--kv-cache-dtype int8" in capsys.readouterr().err


def test_missing_compilers_say_how_to_install_them(tmp_path, tiny):
    env = dict(os.environ, JAXSERVE_COMPILERS=str(tmp_path / "none"), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxserve", "plan", str(tiny), "--target", "v6e-1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "jaxserve plan --install-compilers" in out.stderr and str(tmp_path / "none") in out.stderr


@pytest.mark.parametrize("target, strategy", [("h200", "weight_only"), ("v6e-1", "dynamic_int8")])
def test_quantized_layers_run_as_the_target_runs_them(capsys, target, strategy):
    """--quantization int8 takes the target's strategy (an H200 serves int8 weight-only), not this CPU's."""
    _, r = plan(capsys, CONFIGS / "llama-3-8b", "--target", target, "--quantization", "int8", "--programs", "none")
    assert (r["quantization"], r["quantization_strategy"]) == ("int8", strategy)
