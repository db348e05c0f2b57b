"""Quantized weights in the engine (issue 27, phase 2): `--quantization`, pre-quantized checkpoints, refusals.

1. Each pre-quantized fixture (tests/fixtures/quantized, README there) served by `LLM` reproduces its golden
   logits within the format's tolerance: the dequantized float32 model's logits within 1e-4 where the
   weights run weight-only (int4, and fp8 on a CPU), and the activation-quantized logits within the
   README's RMS / max bands where they run dynamic int8 (W8A8 on a CPU).
2. A format jaxserve cannot read is refused by name at start; `--quantization` that disagrees with the
   checkpoint is an error naming both.
3. stories260K with int8 weights quantized at load keeps float32's next-token argmax on >= 99% of 2,000
   positions of text it samples itself, and its perplexity on its own story rises by <= 1%
   (`benchmarks/quantized_accuracy.py` measures both, for the 124.7M model too).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.entrypoints.research import Workbench
from jaxserve.quantization.checkpoints import UnsupportedQuantization

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "quantized"
# (fixture, golden key, strategy on a CPU, max tolerance, RMS tolerance): README "Tolerances".
CASES = [
    ("awq_int4", "logits", "weight_only", 1e-4, None),
    ("gptq_int4", "logits", "weight_only", 1e-4, None),
    ("gptq_int4_asym", "logits", "weight_only", 1e-4, None),
    ("ct_fp8", "logits", "weight_only", 1e-4, None),
    ("ct_int8_w8a8", "logits_act_quant", "dynamic_int8", 0.25, 0.03),
]


def served_copy(name: str, tmp_path: Path, config_edit=None) -> Path:
    """The fixture beside a 256-token word-level tokenizer (the fixtures carry none; prompts are ids)."""
    from tokenizers import Tokenizer, models
    out = tmp_path / name
    out.mkdir()
    for f in (FIXTURES / name).iterdir():
        if f.name != "golden.npz":
            (out / f.name).symlink_to(f)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(out / "tokenizer.json"))
    if config_edit is not None:
        (out / "config.json").unlink()
        config = json.loads((FIXTURES / name / "config.json").read_text())
        config_edit(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("name, key, strategy, max_tol, rms_tol", CASES)
def test_pre_quantized_fixture_matches_its_golden_logits(name, key, strategy, max_tol, rms_tol, tmp_path):
    golden = np.load(FIXTURES / name / "golden.npz")
    ids = golden["input_ids"].tolist()
    llm = LLM(str(served_copy(name, tmp_path)), max_num_seqs=1, max_model_len=128, token_buckets=(64,))
    spec = llm.engine.model_config.linear_quantization
    assert spec is not None and spec.strategy == strategy
    bench = Workbench(llm)
    seq = bench.new_sequence(len(ids))
    logits = bench.step([(seq, ids)]).logits[0]
    diff = np.abs(logits - golden[key])
    assert diff.max() <= max_tol, (name, float(diff.max()))
    if rms_tol is not None:
        assert np.sqrt((diff ** 2).mean()) <= rms_tol
    else:  # the dequantized model's greedy tokens, every one
        prompt = int(golden["prompt_len"])
        assert logits[prompt - 1:-1].argmax(-1).tolist() == ids[prompt:]
    assert llm.engine.compilations_since_warmup <= 1  # the one step with every row's logits


def test_unsupported_format_is_refused_by_name(tmp_path):
    def bitsandbytes(config):
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(UnsupportedQuantization, match="'bitsandbytes' is not supported"):
        LLM(str(served_copy("awq_int4", tmp_path, bitsandbytes)), max_num_seqs=1, token_buckets=(64,))


@pytest.mark.parametrize("requested", ["int8", "none"])
def test_quantization_flag_that_disagrees_with_the_checkpoint_names_both(requested, tmp_path):
    with pytest.raises(ValueError, match=f"--quantization {requested} disagrees.*AutoAWQ GEMM int4"):
        LLM(str(served_copy("awq_int4", tmp_path)), quantization=requested, max_num_seqs=1, token_buckets=(64,))


def test_int8_weights_keep_the_argmax_and_the_perplexity_of_stories260k(stories_dir):
    spec = importlib.util.spec_from_file_location("quantized_accuracy", ROOT / "benchmarks" / "quantized_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.compare(str(stories_dir), "int8", tokens=2000, max_model_len=512)
    assert result["positions"] >= 2000
    assert result["agreement"] >= 0.99, result
    assert result["perplexity_rise"] <= 0.01, result
