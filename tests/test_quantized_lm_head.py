"""`--quantize-lm-head`: the untied LM head quantized at load with the linear layers (issue 27).

1. On the untied parity fixture with int8 weight-only layers, the quantized head gives the logits of the
   same model whose float head is replaced by its dequantized codes (1e-4), and not those of the float
   head: the head's codes are what runs, nothing else changed. Its parameters are int8 codes [hidden,
   vocab] and per-vocabulary-row scales, the precision line says so and counts the smaller bytes, nothing
   compiles after warm-up.
2. The CPU's default strategy (dynamic int8) runs the head too, adding little to the layers' error.
3. Where there is no head of its own to quantize, or nothing else is quantized at load, it is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.entrypoints.research import Workbench
from jaxserve.quantization import dequantize_weight, quantize_weight
from sharding.rules import logical_axes

ROOT = Path(__file__).resolve().parents[1]
UNTIED = ROOT / "tests" / "fixtures" / "parity" / "llama_gqa_untied"
ENGINE = dict(max_num_seqs=1, max_model_len=128, token_buckets=(64,))


def with_head(tmp_path: Path, head: np.ndarray) -> Path:
    """The fixture with its LM head [vocab, hidden] replaced by `head`."""
    out = tmp_path / "replaced-head"
    out.mkdir()
    for f in UNTIED.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    tensors = load_file(UNTIED / "model.safetensors")
    # safetensors writes the array's memory as it lies: a transposed view must be made contiguous
    tensors["lm_head.weight"] = np.ascontiguousarray(head, tensors["lm_head.weight"].dtype)
    save_file(tensors, out / "model.safetensors")
    return out


def prompt_logits(llm: LLM) -> np.ndarray:
    ids = np.load(UNTIED / "golden.npz")["input_ids"].tolist()
    bench = Workbench(llm)
    return bench.step([(bench.new_sequence(len(ids)), ids)]).logits[0]


def test_the_quantized_head_runs_its_codes(tmp_path, id_tokenizer):
    weight_only = dict(quantization="int8", quantization_strategy="weight_only", tokenizer=str(id_tokenizer),
                       **ENGINE)
    quantized = LLM(str(UNTIED), quantize_lm_head=True, **weight_only)
    float_head = LLM(str(UNTIED), **weight_only)
    head = load_file(UNTIED / "model.safetensors")["lm_head.weight"]  # [vocab, hidden]
    dequantized = np.asarray(dequantize_weight(quantize_weight(head.T.astype(np.float32), "int8"))).T
    reference = LLM(str(with_head(tmp_path, dequantized)), **weight_only)

    params = quantized.engine.runner.params["lm_head"]
    assert params["codes"][...].dtype == np.int8 and params["codes"][...].shape == (64, 256)
    assert params["scales"][...].shape == (1, 256)
    assert "kernel" not in params
    precision = quantized.engine.precision
    assert "linear layers and LM head int8" in precision.describe()
    # The head went from 4 bytes a weight to 1 (plus a scale per vocabulary row).
    assert float_head.engine.precision.weight_bytes - precision.weight_bytes == 64 * 256 * 3 - 256 * 4

    got = prompt_logits(quantized)
    np.testing.assert_allclose(got, prompt_logits(reference), atol=1e-4)
    assert np.abs(got - prompt_logits(float_head)).max() > 1e-4  # the float head's logits are not these
    out = quantized.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert quantized.engine.compilations_since_warmup <= 1  # the Workbench's one step with every row's logits


def test_the_default_cpu_strategy_runs_the_head_in_int8(id_tokenizer):
    """Dynamic int8 quantizes the head's input rows too: its error against transformers' float logits stays
    within a tenth of what the quantized layers alone cost (measured: RMS 0.0470 against 0.0454)."""
    dynamic = dict(quantization="int8", tokenizer=str(id_tokenizer), **ENGINE)
    with_head = LLM(str(UNTIED), quantize_lm_head=True, **dynamic)
    assert with_head.engine.model_config.linear_quantization.strategy == "dynamic_int8"
    golden = np.load(UNTIED / "golden.npz")["logits"]
    head_error = prompt_logits(with_head) - golden
    layers_error = prompt_logits(LLM(str(UNTIED), **dynamic)) - golden
    assert np.sqrt((head_error ** 2).mean()) <= 1.1 * np.sqrt((layers_error ** 2).mean())
    assert np.abs(head_error).max() <= 1.1 * np.abs(layers_error).max()


def test_the_head_shards_over_the_vocabulary_like_the_float_one():
    for part in ("kernel", "codes", "scales"):
        assert logical_axes(("lm_head", part), 2) == (None, "vocab")


@pytest.mark.parametrize("model, kwargs, message", [
    ("stories260K", dict(quantization="int8"), "no LM head of its own"),
    ("untied", dict(), "needs --quantization"),
])
def test_refused_where_it_cannot_apply(model, kwargs, message, stories_dir, id_tokenizer):
    path, tokenizer = (stories_dir, None) if model == "stories260K" else (UNTIED, str(id_tokenizer))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), quantize_lm_head=True, tokenizer=tokenizer, **ENGINE, **kwargs)


def test_refused_for_a_pre_quantized_checkpoint(tmp_path):
    from tests.test_quantized_weights_engine import served_copy as quantized_copy
    with pytest.raises(ValueError, match="quantizes a float checkpoint at load"):
        LLM(str(quantized_copy("gptq_int4", tmp_path)), quantize_lm_head=True, **ENGINE)
