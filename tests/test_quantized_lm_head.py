"""`--quantize-lm-head` and `--quantize-embedding`: the untied LM head and token embedding quantized at load
with the linear layers (issue 27).

1. On the untied parity fixture with int8 weight-only layers, the quantized head gives the logits of the
   same model whose float head is replaced by its dequantized codes (1e-4), and not those of the float
   head: the head's codes are what runs, nothing else changed. Its parameters are int8 codes [hidden,
   vocab] and per-vocabulary-row scales, the precision line says so and counts the smaller bytes, nothing
   compiles after warm-up. The engines that only give logits to compare (here and below) skip warm-up
   (`LLM(warmup=False)`): the one program they run is the Workbench's, the served step with every row's logits.
2. The CPU's default strategy (dynamic int8) runs the head too, adding little to the layers' error.
3. Where there is no head of its own to quantize, or nothing else is quantized at load, it is refused.
4. The embedding the same way: codes [vocab, hidden] and one scale per token row give the logits of the
   model whose float table is its dequantized codes; split over the vocabulary on two devices, the same
   logits; refused for a table tied to the head.
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


def with_head(tmp_path: Path, head: np.ndarray, name: str = "lm_head.weight") -> Path:
    """The fixture with its LM head [vocab, hidden] (or the tensor `name`) replaced by `head`."""
    out = tmp_path / f"replaced-{name}"
    out.mkdir()
    for f in UNTIED.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    tensors = load_file(UNTIED / "model.safetensors")
    # safetensors writes the array's memory as it lies: a transposed view must be made contiguous
    tensors[name] = np.ascontiguousarray(head, tensors[name].dtype)
    save_file(tensors, out / "model.safetensors")
    return out


def prompt_logits(llm: LLM) -> np.ndarray:
    ids = np.load(UNTIED / "golden.npz")["input_ids"].tolist()
    bench = Workbench(llm)
    return bench.step([(bench.new_sequence(len(ids)), ids)]).logits[0]


def three_engines(tmp_path: Path, id_tokenizer, flag: str, name: str, warmup: bool) -> tuple[LLM, LLM, LLM]:
    """int8 weight-only engines on the untied fixture: with `flag` (the tensor `name` [vocab, hidden]
    quantized, one scale per vocabulary row; warmed up as `warmup` says), without it, and without it over a
    copy whose `name` is the dequantized codes (these two only give logits: no warm-up)."""
    weight_only = dict(quantization="int8", quantization_strategy="weight_only", tokenizer=str(id_tokenizer),
                       **ENGINE)
    table = load_file(UNTIED / "model.safetensors")[name]
    # One scale per vocabulary row: the per-column scales of the transposed table.
    dequantized = np.asarray(dequantize_weight(quantize_weight(table.T.astype(np.float32), "int8"))).T
    return (LLM(str(UNTIED), **{flag: True}, warmup=warmup, **weight_only),
            LLM(str(UNTIED), warmup=False, **weight_only),
            LLM(str(with_head(tmp_path, dequantized, name)), warmup=False, **weight_only))


def test_the_quantized_head_runs_its_codes(tmp_path, id_tokenizer):
    quantized, float_head, reference = three_engines(tmp_path, id_tokenizer, "quantize_lm_head", "lm_head.weight",
                                                     warmup=True)  # it serves below: nothing compiles then

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
    with_head = LLM(str(UNTIED), quantize_lm_head=True, warmup=False, **dynamic)
    assert with_head.engine.model_config.linear_quantization.strategy == "dynamic_int8"
    golden = np.load(UNTIED / "golden.npz")["logits"]
    head_error = prompt_logits(with_head) - golden
    layers_error = prompt_logits(LLM(str(UNTIED), warmup=False, **dynamic)) - golden
    assert np.sqrt((head_error ** 2).mean()) <= 1.1 * np.sqrt((layers_error ** 2).mean())
    assert np.abs(head_error).max() <= 1.1 * np.abs(layers_error).max()


def test_the_head_shards_over_the_vocabulary_like_the_float_one():
    for part in ("kernel", "codes", "scales"):
        assert logical_axes(("lm_head", part), 2) == (None, "vocab")


@pytest.mark.parametrize("flag, model, kwargs, message", [
    ("quantize_lm_head", "stories260K", dict(quantization="int8"), "no LM head of its own"),
    ("quantize_lm_head", "untied", dict(), "needs --quantization"),
    ("quantize_embedding", "stories260K", dict(quantization="int8"), "embedding is its LM head too"),
    ("quantize_embedding", "untied", dict(), "--quantize-embedding needs --quantization"),
])
def test_refused_where_it_cannot_apply(flag, model, kwargs, message, stories_dir, id_tokenizer):
    path, tokenizer = (stories_dir, None) if model == "stories260K" else (UNTIED, str(id_tokenizer))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), **{flag: True}, tokenizer=tokenizer, **ENGINE, **kwargs)


@pytest.mark.parametrize("flag", ["quantize_lm_head", "quantize_embedding"])
def test_refused_for_a_pre_quantized_checkpoint(flag, tmp_path):
    from tests.test_quantized_weights_engine import served_copy as quantized_copy
    with pytest.raises(ValueError, match="quantizes a float checkpoint at load"):
        LLM(str(quantized_copy("gptq_int4", tmp_path)), **{flag: True}, **ENGINE)


def test_the_quantized_embedding_looks_up_its_codes(tmp_path, id_tokenizer):
    quantized, float_table, reference = three_engines(tmp_path, id_tokenizer, "quantize_embedding",
                                                      "model.embed_tokens.weight", warmup=False)

    params = quantized.engine.runner.params["embed_tokens"]
    assert params["codes"][...].dtype == np.int8 and params["codes"][...].shape == (256, 64)
    assert params["scales"][...].shape == (256, 1) and "embedding" not in params
    precision = quantized.engine.precision
    assert "linear layers and token embedding int8" in precision.describe()
    assert float_table.engine.precision.weight_bytes - precision.weight_bytes == 256 * 64 * 3 - 256 * 4

    got = prompt_logits(quantized)
    np.testing.assert_allclose(got, prompt_logits(reference), atol=1e-4)
    assert np.abs(got - prompt_logits(float_table)).max() > 1e-4
    assert quantized.engine.compilations_since_warmup <= 1  # never warmed up: the Workbench's step is all it compiled

    # Converted once (`jaxserve convert --quantization int8 --quantize-embedding`), served as stored.
    from jaxserve.loader.convert import convert
    converted = convert(UNTIED, tmp_path / "converted", format="mapped", quantization="int8", quantize_embedding=True)
    stored = LLM(str(converted), tokenizer=str(id_tokenizer), quantization_strategy="weight_only", warmup=False,
                 **ENGINE)
    assert "linear layers and token embedding int8" in stored.engine.precision.describe()
    np.testing.assert_array_equal(prompt_logits(stored), got)


EMBEDDING_TP_SCRIPT = """
import json, sys
import numpy as np
from jaxserve import LLM
from jaxserve.entrypoints.research import Workbench
ids = np.load(sys.argv[1])["input_ids"].tolist()
result = {}
for tp in (1, 2):
    llm = LLM(sys.argv[2], tokenizer=sys.argv[3], quantization="int8", quantization_strategy="weight_only",
              quantize_embedding=True, quantize_lm_head=True, tensor_parallel_size=tp, max_num_seqs=1,
              max_model_len=128, token_buckets=(64,), warmup=False)
    bench = Workbench(llm)
    result[tp] = {"logits": bench.step([(bench.new_sequence(len(ids)), ids)]).logits[0].tolist(),
                  "codes": str(llm.engine.runner.params["embed_tokens"]["codes"][...].sharding.spec)}
print("RESULT " + json.dumps(result))
"""


def test_the_quantized_embedding_splits_over_the_vocabulary(id_tokenizer):
    """Each device looks up the tokens in its rows of codes and scales; the all-reduce assembles the same
    embeddings (one non-zero term), so two devices give one device's logits."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", EMBEDDING_TP_SCRIPT, str(UNTIED / "golden.npz"), str(UNTIED),
                           str(id_tokenizer)], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert "tensor" in result["2"]["codes"] and result["2"]["codes"].endswith(", None)")
    np.testing.assert_allclose(result["2"]["logits"], result["1"]["logits"], atol=1e-4)


def test_the_embedding_shards_over_the_vocabulary_like_the_float_one():
    for part in ("embedding", "codes", "scales"):
        assert logical_axes(("embed_tokens", part), 2) == ("vocab", None)
