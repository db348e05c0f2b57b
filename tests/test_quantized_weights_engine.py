"""Quantized weights in the engine (issue 27, phase 2): `--quantization`, pre-quantized checkpoints, refusals.

1. Each pre-quantized fixture (tests/fixtures/quantized, README there) served by `LLM` reproduces its golden
   logits within the format's tolerance: the dequantized float32 model's logits within 1e-4 where the
   weights run weight-only (int4, and fp8 on a CPU), and the activation-quantized logits within the
   README's RMS / max bands, and nearer than the weight-only ones, where they run dynamic int8 (W8A8 on a
   CPU).
   Converted (`jaxserve convert`, mapped and Orbax) they serve the same logits; an int8 conversion of
   stories260K is read in place and serves what quantizing at load serves.
2. A format jaxserve cannot read is refused by name at start; `--quantization` that disagrees with the
   checkpoint is an error naming both.
3. stories260K with int8 weights quantized at load keeps float32's next-token argmax on >= 99% of 2,000
   positions of text it samples itself, and its perplexity on its own story rises by <= 1% (weight-only;
   the CPU's default dynamic int8, which quantizes activations too, is held to 97.5% and 1%);
   `benchmarks/quantized_accuracy.py` measures both, for the 124.7M model too.
4. Two fake devices: tensor parallelism (codes and scales sharded by the rules, the story kept, from the
   Hugging Face checkpoint and from an int8 Orbax conversion), two pipeline stages (the same tokens), and
   int4 group scales split with their rows (golden logits kept).
The engines that only give logits through `Workbench.step` skip warm-up (`LLM(warmup=False)`): the one program
they run is the Workbench's, the served step with every row's logits (and the one a step may compile).
"""

from __future__ import annotations

import dataclasses
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
    _check_golden(served_copy(name, tmp_path), name, key, strategy, max_tol, rms_tol)


# Each 4-bit layout (int4 without zeros, uint4 with) and each 8-bit one, in one of the two formats each.
CONVERTED = [("gptq_int4", "orbax"), ("awq_int4", "mapped"), ("ct_fp8", "mapped"), ("ct_int8_w8a8", "orbax")]


@pytest.mark.parametrize("name, fmt", CONVERTED)
def test_converted_pre_quantized_fixture_matches_its_golden_logits(name, fmt, tmp_path):
    """`jaxserve convert` stores the layers as they run (4-bit codes one per byte); the converted directory
    serves the same logits, within the same tolerance, as the Hugging Face one."""
    from jaxserve.loader.convert import convert
    case = next(c for c in CASES if c[0] == name)
    out = convert(served_copy(name, tmp_path), tmp_path / f"{name}-{fmt}", format=fmt)
    _check_golden(out, *case)


def _check_golden(model_dir: Path, name, key, strategy, max_tol, rms_tol):
    golden = np.load(FIXTURES / name / "golden.npz")
    ids = golden["input_ids"].tolist()
    llm = LLM(str(model_dir), max_num_seqs=1, max_model_len=128, token_buckets=(64,), warmup=False)
    spec = llm.engine.model_config.linear_quantization
    assert spec is not None and spec.strategy == strategy
    precision = llm.engine.precision
    assert (precision.linear_codes, precision.linear_strategy) == (spec.codes, strategy)
    assert spec.source.split()[0] in precision.describe()  # the format's summary is in the startup log
    bench = Workbench(llm)
    seq = bench.new_sequence(len(ids))
    logits = bench.step([(seq, ids)]).logits[0]
    diff = np.abs(logits - golden[key])
    assert diff.max() <= max_tol, (name, float(diff.max()))
    if key != "logits":
        # The goldens with and without activation quantization are 0.217 apart (RMS 0.039), inside the max
        # tolerance: the served logits must be nearer the one whose activations were quantized (measured on
        # ct_int8_w8a8: RMS 0.011 from it, 0.039 from the weight-only one).
        near, far = (float(np.sqrt(((logits - golden[k]) ** 2).mean())) for k in (key, "logits"))
        assert near < far, f"{name}: RMS {near:.4f} from {key} but {far:.4f} from the weight-only logits"
    if rms_tol is not None:
        assert np.sqrt((diff ** 2).mean()) <= rms_tol
    else:  # the dequantized model's greedy tokens, every one
        prompt = int(golden["prompt_len"])
        assert logits[prompt - 1:-1].argmax(-1).tolist() == ids[prompt:]
    assert llm.engine.compilations_since_warmup <= 1  # the one step with every row's logits, all it compiled


def test_dtype_warnings_say_what_differs_from_what_was_asked():
    from jaxserve.config import LinearQuantization, ModelConfig
    from jaxserve.engine.precision import dtype_warnings
    config = ModelConfig.from_pretrained(FIXTURES / "awq_int4")  # stores float32
    assert dtype_warnings("auto", None, config, np.float32, "cpu") == []
    assert "stores float32 weights, converted to bfloat16" in dtype_warnings("bfloat16", None, config, "bfloat16",
                                                                             "cpu")[0]
    awq = dataclasses.replace(config, linear_quantization=LinearQuantization("uint4", 32, source="AutoAWQ GEMM"))
    assert "linear layers stay uint4" in dtype_warnings("bfloat16", None, awq, "bfloat16", "gpu")[0]
    fp8 = dataclasses.replace(config, linear_quantization=LinearQuantization("fp8"))
    assert "--quantization int8 is the fast option" in dtype_warnings("auto", "fp8", fp8, np.float32, "cpu")[0]
    half = dtype_warnings("float16", None, config, "float16", "cpu")
    assert any("no fast float16 products" in w for w in half)
    assert not any("float16 products" in w for w in dtype_warnings("float16", None, config, "float16", "gpu"))
    assert dtype_warnings("auto", "fp8", fp8, np.float32, "gpu") == []


def test_int8_conversion_is_read_in_place_and_serves_what_quantizing_at_load_serves(stories_dir, tmp_path):
    """`jaxserve convert --quantization int8`: the mapped file holds the codes and scales, a start uses them
    where they lie (nothing quantized, nothing copied on CPU), and serves the tokens that quantizing the
    Hugging Face checkpoint at load serves; what the stored layers cannot be is refused by name."""
    import jax
    import jax.numpy as jnp
    from jaxserve import SamplingParams
    from jaxserve.config import ModelConfig
    from jaxserve.entrypoints.cli import main as cli_main
    from jaxserve.loader.abstract import AbstractModel
    from jaxserve.loader.formats import Checkpoint
    from jaxserve.loader.load import load_checkpoint, load_sharded
    from jaxserve.loader.quantized import QuantizationFlags
    from jaxserve.loader.safetensors import read_header
    from sharding import ParallelConfig, make_plan

    mapped = tmp_path / "int8-mapped"
    assert cli_main(["convert", "--model", str(stories_dir), "--output", str(mapped), "--format", "mapped",
                     "--quantization", "int8"]) == 0
    tensors = read_header(mapped / "model.safetensors")[1]
    assert tensors["layers.0.mlp.down_proj.codes"] == {**tensors["layers.0.mlp.down_proj.codes"], "dtype": "I8",
                                                       "shape": [172, 64]}
    assert tensors["layers.0.mlp.down_proj.scales"]["shape"] == [1, 64]
    assert tensors["embed_tokens.embedding"]["dtype"] == "F32"  # embeddings and norms stay float

    config = ModelConfig.from_pretrained(stories_dir)
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    stored = load_sharded(mapped, config, jnp.float32, plan)
    assert stored.config.linear_quantization.codes == "int8"
    hugging_face = Checkpoint.read(stories_dir)
    int8 = hugging_face.served_config(config, QuantizationFlags("int8"))
    at_load = load_checkpoint(hugging_face, AbstractModel(int8, jnp.float32, plan))
    a, b = (dict(jax.tree_util.tree_leaves_with_path(m.params)) for m in (stored, at_load))
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(np.asarray(a[path]), np.asarray(b[path]), err_msg=str(path))
    from tests.test_mapped_checkpoint import _mapped_ranges
    ranges = _mapped_ranges(mapped / "model.safetensors")
    for path, leaf in a.items():
        pointer = leaf.addressable_shards[0].data.unsafe_buffer_pointer()
        assert any(begin <= pointer < end for begin, end in ranges), path

    params = SamplingParams(temperature=0, max_tokens=32)
    served = LLM(str(mapped), max_num_seqs=1, max_model_len=128, token_buckets=(64,))
    assert (served.engine.precision.linear_codes, served.engine.precision.linear_strategy) == ("int8", "dynamic_int8")
    # the startup log says where the codes came from: read as stored, not quantized at every start
    assert served.engine.precision.linear_source == "quantized by `jaxserve convert`"
    reference = LLM(str(stories_dir), quantization="int8", max_num_seqs=1, max_model_len=128, token_buckets=(64,))
    assert (served.generate(["Once upon a time"], params)[0].outputs[0].token_ids ==
            reference.generate(["Once upon a time"], params)[0].outputs[0].token_ids)

    with pytest.raises(ValueError, match="--quantization fp8 disagrees with the converted checkpoint.*int8"):
        LLM(str(mapped), quantization="fp8", max_num_seqs=1, token_buckets=(64,))
    with pytest.raises(ValueError, match="--quantize-lm-head: this converted checkpoint stores a float LM head"):
        LLM(str(mapped), quantize_lm_head=True, max_num_seqs=1, token_buckets=(64,))
    with pytest.raises(ValueError, match="already a converted checkpoint"):
        from jaxserve.loader.convert import convert
        convert(mapped, tmp_path / "again", format="mapped")


def test_unsupported_format_is_refused_by_name(tmp_path):
    def bitsandbytes(config):
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(UnsupportedQuantization, match="'bitsandbytes' is not supported"):
        LLM(str(served_copy("awq_int4", tmp_path, bitsandbytes)), max_num_seqs=1, token_buckets=(64,))


@pytest.mark.parametrize("requested", ["int8", "none"])
def test_quantization_flag_that_disagrees_with_the_checkpoint_names_both(requested, tmp_path):
    with pytest.raises(ValueError, match=f"--quantization {requested} disagrees.*AutoAWQ GEMM int4"):
        LLM(str(served_copy("awq_int4", tmp_path)), quantization=requested, max_num_seqs=1, token_buckets=(64,))


def test_a_conversion_marker_from_before_quantize_embedding_reads_as_a_float_embedding(tmp_path):
    """Conversions written before `--quantize-embedding` have no `embedding` key in their marker: their
    embedding is float, and every reader sees that key filled in."""
    from jaxserve.loader.formats import MARKER, Checkpoint
    entry = {"codes": "int8", "block_size": None, "lm_head": True, "source": "quantized at load",
             "float_activations": False}
    (tmp_path / MARKER).write_text(json.dumps({"format": "mapped", "linear_quantization": entry}))
    assert Checkpoint.read(tmp_path).stored == {**entry, "embedding": False}
    embedded = {**entry, "embedding": True}
    (tmp_path / MARKER).write_text(json.dumps({"format": "mapped", "linear_quantization": embedded}))
    assert Checkpoint.read(tmp_path).stored["embedding"] is True
    (tmp_path / MARKER).write_text(json.dumps({"format": "mapped"}))
    assert Checkpoint.read(tmp_path).stored is None  # float layers
    assert Checkpoint.read(FIXTURES / "awq_int4").stored is None  # a Hugging Face directory


def test_fp8_checkpoint_is_re_quantized_to_int8_when_asked(tmp_path):
    """`--quantization int8` on an fp8 checkpoint: each layer's fp8 weights, dequantized, quantized again per
    output channel, so a CPU runs its integer products instead of fp8 weight-only. Every int8 weight is
    within half a step of its fp8 value; the dequantized fp8 model's greedy tokens hold (measured: logits
    within max 0.30 / RMS 0.050 of its golden, dynamic int8 adding activation rounding)."""
    from jaxserve.loader.safetensors import SafetensorsReader
    from jaxserve.quantization import QuantizedWeight, dequantize_weight
    from jaxserve.quantization.checkpoints import detect_checkpoint_quantization
    model = served_copy("ct_fp8", tmp_path)
    llm = LLM(str(model), quantization="int8", max_num_seqs=1, max_model_len=128, token_buckets=(64,), warmup=False)
    spec = llm.engine.model_config.linear_quantization
    assert (spec.codes, spec.strategy) == ("int8", "dynamic_int8") and "re-quantized to int8" in spec.source
    assert "re-quantized to int8" in llm.engine.precision.describe()

    ckpt = detect_checkpoint_quantization(json.loads((model / "config.json").read_text()), model)
    stored = SafetensorsReader(model)
    fp8 = np.asarray(dequantize_weight(ckpt.read_linear("model.layers.1.mlp.down_proj", stored.tensor)))
    stored.close()
    down = llm.engine.runner.params["layers"][1]["mlp"]["down_proj"]
    codes, scales = np.asarray(down["codes"][...]), np.asarray(down["scales"][...])
    assert codes.dtype == np.int8
    int8 = np.asarray(dequantize_weight(QuantizedWeight(codes, scales, None)))
    assert np.all(np.abs(int8 - fp8) <= scales / 2 + 1e-7)

    golden = np.load(FIXTURES / "ct_fp8" / "golden.npz")
    ids, prompt = golden["input_ids"].tolist(), int(golden["prompt_len"])
    bench = Workbench(llm)
    logits = bench.step([(bench.new_sequence(len(ids)), ids)]).logits[0]
    assert logits[prompt - 1:-1].argmax(-1).tolist() == ids[prompt:]
    diff = np.abs(logits - golden["logits"])
    assert diff.max() <= 0.4 and np.sqrt((diff ** 2).mean()) <= 0.06, (diff.max(), np.sqrt((diff ** 2).mean()))
    with pytest.raises(ValueError, match="only fp8 checkpoints can be re-quantized"):
        LLM(str(served_copy("gptq_int4", tmp_path)), quantization="int8", max_num_seqs=1, token_buckets=(64,))


def test_int8_weights_keep_the_argmax_and_the_perplexity_of_stories260k(stories_dir):
    spec = importlib.util.spec_from_file_location("quantized_accuracy", ROOT / "benchmarks" / "quantized_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    weight_only, dynamic = bench.compare(
        str(stories_dir), [dict(quantization="int8", quantization_strategy="weight_only"), dict(quantization="int8")],
        tokens=2000, max_model_len=512)
    assert weight_only["positions"] >= 2000 and dynamic["strategy"] == "dynamic_int8"
    # int8 weights with float activations: measured 99.07% and +0.18%.
    assert weight_only["agreement"] >= 0.99 and weight_only["perplexity_rise"] <= 0.01, weight_only
    # The CPU's fast path also quantizes each token's activations (vLLM's W8A8): measured 98.24% and +0.43%;
    # the flips are near ties of the sampled text (the perplexity barely moves).
    assert dynamic["agreement"] >= 0.975 and dynamic["perplexity_rise"] <= 0.01, dynamic


TP_SCRIPT = """
import json, sys
from flax import nnx
from jaxserve import LLM, SamplingParams
result = {}
# The Hugging Face checkpoint quantized at load on one device, split over two (tensor parallel, then two
# pipeline stages), and its int8 Orbax conversion restored onto two (each device reading its slices).
for name, model, quantization, tp, pp in (("1", sys.argv[1], "int8", 1, 1), ("2", sys.argv[1], "int8", 2, 1),
                                          ("pp2", sys.argv[1], "int8", 1, 2), ("orbax2", sys.argv[2], None, 2, 1)):
    llm = LLM(model, quantization=quantization, kv_cache_dtype="int8", tensor_parallel_size=tp,
              pipeline_parallel_size=pp, max_num_seqs=2, max_model_len=64,
              token_buckets=(16,))  # one program: it decodes a single sequence
    params = nnx.to_pure_dict(llm.engine.runner.params)
    q = params["layers"][0]["self_attn"]["q_proj"]
    down = params["layers"][0]["mlp"]["down_proj"]
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    result[name] = {"tokens": list(out.token_ids), "compiled": llm.engine.compilations_since_warmup,
                  "q_codes": str(q["codes"].sharding.spec), "q_scales": str(q["scales"].sharding.spec),
                  "down_codes": str(down["codes"].sharding.spec), "down_scales": str(down["scales"].sharding.spec),
                  "kv_scales": str(llm.engine.runner.kv_cache.k[0].scales.sharding.spec)}
print("RESULT " + json.dumps(result))
"""


def test_tensor_parallel_int8_weights_and_pages_on_two_fake_devices(stories_dir, tmp_path):
    """Codes and scales follow the partition rules (row-parallel per-channel scales replicated), each shard
    quantizes its own activations, and the greedy story survives the split; two pipeline stages keep the
    one-device tokens exactly; an int8 Orbax conversion restores onto the two devices as quantizing at
    load places them."""
    import os
    import subprocess
    import sys
    from jaxserve.loader.convert import convert
    orbax = convert(stories_dir, tmp_path / "int8-orbax", format="orbax", quantization="int8")
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(stories_dir), str(orbax)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    one, two, restored = result["1"], result["2"], result["orbax2"]
    assert one["compiled"] == two["compiled"] == restored["compiled"] == 0
    assert restored == two  # the same codes on the same shards: the same tokens
    assert result["pp2"]["compiled"] == 0
    assert result["pp2"]["tokens"] == one["tokens"]  # stages split layers, not products: nothing rounds apart
    assert "tensor" in two["q_codes"] and "tensor" in two["q_scales"]  # column-parallel: split on out
    assert "tensor" in two["down_codes"] and "tensor" not in two["down_scales"]  # row-parallel: one block
    assert "tensor" in two["kv_scales"]  # split over KV heads with their pages
    # Per-token activation scales differ between a whole row and its two halves, so late tokens may
    # differ; the story's opening must not.
    assert two["tokens"][:16] == one["tokens"][:16], (one["tokens"], two["tokens"])


GROUPS_TP_SCRIPT = """
import json, sys
import numpy as np
from flax import nnx
from jaxserve import LLM
from jaxserve.entrypoints.research import Workbench
result = {}
for model, golden in zip(sys.argv[1::2], sys.argv[2::2]):
    golden = np.load(golden)
    llm = LLM(model, tensor_parallel_size=2, max_num_seqs=1, max_model_len=128, token_buckets=(64,), warmup=False)
    down = nnx.to_pure_dict(llm.engine.runner.params)["layers"][0]["mlp"]["down_proj"]
    bench = Workbench(llm)
    logits = bench.step([(bench.new_sequence(64), golden["input_ids"].tolist())]).logits[0]
    result[model] = {"max_diff": float(np.abs(logits - golden["logits"]).max()),
                     **{part: str(down[part].sharding.spec) for part in ("codes", "scales", "zeros")}}
print("RESULT " + json.dumps(result))
"""


def test_int4_group_scales_split_with_their_rows_under_tensor_parallelism(tmp_path):
    """A row-parallel layer's input rows are split over the devices, and with them its groups of 32 or 64
    rows: each device holds the scales and zero points of its own rows, and the dequantized model's
    golden logits hold within 1e-4 (AWQ groups of 32: two per device in the down projection; GPTQ
    asymmetric groups of 64: one per device)."""
    import os
    import subprocess
    import sys
    args = [str(a) for name in ("awq_int4", "gptq_int4_asym")
            for a in (served_copy(name, tmp_path), FIXTURES / name / "golden.npz")]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", GROUPS_TP_SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert len(result) == 2
    for model, r in result.items():
        assert r["max_diff"] <= 1e-4, (model, r)
        for part in ("codes", "scales", "zeros"):  # split on the input (row, group) axis, not the output one
            assert "tensor" in r[part] and r[part].endswith(", None)"), (model, part, r[part])
