"""The engine's choice between XLA's product and the Pallas kernels for weight-only quantized layers (issue 52).

1. Forced onto the kernels (`quantized_matmul="pallas"`, interpret mode on the CPU): a tiny int8 model (the
   random demo model, quantized at load, run weight-only; the Triton flavour) gives the greedy tokens of the
   same engine on XLA's product and compiles nothing after warm-up; a tiny uint4 one with zero points (the
   AWQ fixture; the Mosaic flavour) keeps the golden greedy tokens XLA's product keeps. An engine start is
   most of a test's time, so the uint4 one is checked against the golden alone.
2. The choice at start (`jaxserve/engine/kernel_choice.py`), with the device timings stood in for: a CPU
   engine's model is returned untouched ("auto" measures nothing there); on a GPU each distinct product is
   timed at the fewest and the most decode rows and bisected only where they disagree, the plan lands on
   every layer of the shape, and the log names each shape's path. The timing itself runs here too
   (interpret mode), as it would on a device.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.engine import kernel_choice
from jaxserve.engine.builder import build_model
from jaxserve.engine_args import EngineArgs
from jaxserve.model.linear_kernels import KernelPlan
from jaxserve.model.quantized_linear import QuantizedLinear
from tests.test_quantized_weights_engine import FIXTURES, served_copy

STORIES = str(Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K")
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# One token bucket of 4 (prompts prefill in chunks): one step program per engine, every product decode-sized.
SMALL = dict(max_num_seqs=2, max_model_len=64, token_buckets=(4,), max_num_batched_tokens=4)
INT8_WEIGHT_ONLY = dict(quantization="int8", quantization_strategy="weight_only")


def greedy_tokens(model: str, prompts, **options) -> list[list[int]]:
    llm = LLM(model, **SMALL, **options)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    assert llm.engine.compilations_since_warmup == 0
    return tokens


def kernel_plans(llm_or_model) -> dict[str, KernelPlan | None]:
    module = nnx.merge(llm_or_model.graphdef, llm_or_model.params)
    return {"/".join(map(str, path)): node.kernel for path, node in nnx.iter_graph(module)
            if isinstance(node, QuantizedLinear)}


def test_int8_kernels_give_the_greedy_tokens_of_xla(monkeypatch, caplog):
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "triton")
    prompts = [[5, 9, 33], [1, 2, 3, 4, 5, 6, 7]]
    want = greedy_tokens("demo-random", prompts, quantized_matmul="xla", **INT8_WEIGHT_ONLY)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.kernel_choice"):
        got = greedy_tokens("demo-random", prompts, quantized_matmul="pallas", **INT8_WEIGHT_ONLY)
    assert got == want
    chosen = [r.getMessage() for r in caplog.records if r.name == "jaxserve.engine.kernel_choice"]
    assert len(chosen) == 4 and all("pallas-triton (interpret) for 1-64 rows" in line for line in chosen), chosen


def test_uint4_kernels_keep_the_golden_tokens_xla_keeps(tmp_path, monkeypatch):
    """The AWQ fixture's golden continuation (its dequantized model's greedy tokens, each with a top-1 / top-2
    gap over 1e-2: what XLA's product gives, tests/test_quantized_weights_engine.py) through the Mosaic kernel:
    the 48-token prompt and every decode step run 64-row products in one token bucket."""
    monkeypatch.setenv("JAXSERVE_PALLAS_CPU_FLAVOUR", "mosaic")
    golden = np.load(FIXTURES / "awq_int4" / "golden.npz")
    ids, prompt = golden["input_ids"].tolist(), int(golden["prompt_len"])
    llm = LLM(str(served_copy("awq_int4", tmp_path)), quantized_matmul="pallas", max_num_seqs=1, max_model_len=128,
              token_buckets=(64,))
    assert all(plan == KernelPlan("mosaic", (64,), (True,), interpret=True)
               for plan in kernel_plans(llm.engine.runner).values())
    out = llm.generate([ids[:prompt]], SamplingParams(temperature=0, max_tokens=len(ids) - prompt, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == ids[prompt:]
    assert llm.engine.compilations_since_warmup == 0


@pytest.fixture(scope="module")
def stories_int8():
    """stories260K's model on its (CPU) device, int8 weight-only, token buckets 1..64 and one of 128."""
    args = EngineArgs(model=STORIES, max_num_seqs=4, max_model_len=128, token_buckets=(1, 2, 4, 8, 16, 32, 64, 128),
                      **INT8_WEIGHT_ONLY)
    built = build_model(args)
    assert all(plan is None for plan in kernel_plans(built.model).values())  # "auto" on a CPU: XLA's
    return built


def test_auto_on_a_cpu_leaves_the_model_as_it_is(stories_int8):
    model = stories_int8.model
    assert kernel_choice.choose_linear_kernels(model, "auto", "cpu", (1, 4, 64)) is model
    assert kernel_choice.choose_linear_kernels(model, "xla", "gpu", (1, 4, 64)) is model


def test_auto_on_a_gpu_times_each_shape_and_bisects_the_rows(stories_int8, monkeypatch, caplog):
    timed = []

    def fake_timing(shape, rows, flavour, device):  # the kernel wins up to 8 rows on the MLP's products
        timed.append((shape.k, shape.n, rows))
        wins = rows <= 8 and 172 in (shape.k, shape.n)
        return 10e-6, (5e-6 if wins else 20e-6)

    monkeypatch.setattr(kernel_choice, "time_products", fake_timing)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.kernel_choice"):
        model = kernel_choice.choose_linear_kernels(stories_int8.model, "auto", "gpu", (1, 2, 4, 8, 16, 32, 64, 128))
    plans = kernel_plans(model)
    mlp = KernelPlan("triton", (8, 64), (True, False))
    for path, plan in plans.items():  # the attention's products: XLA's at every row count, so no plan
        assert plan == (mlp if path.endswith(("gate_proj", "up_proj", "down_proj")) else None), path
    assert mlp.runs_kernel(1) and mlp.runs_kernel(8) and not mlp.runs_kernel(9) and not mlp.runs_kernel(128)
    # Four shapes (q/o 64x64, k/v 64x32, gate/up 64x172, down 172x64); rows 1..64 (128 is a prefill's).
    # Agreeing ends settle a shape in two timings; the MLP's bisect: 1 and 64 disagree, 8 and 16 find the edge.
    per_shape = {}
    for k, n, rows in timed:
        per_shape.setdefault((k, n), []).append(rows)
    assert {s: len(r) for s, r in per_shape.items()} == {(64, 64): 2, (64, 32): 2, (64, 172): 4, (172, 64): 4}
    lines = [r.getMessage() for r in caplog.records if "weight-only 64x172" in r.getMessage()]
    assert lines and "pallas-triton for 1-8 rows, XLA for 9-64 rows" in lines[0] and "against XLA's" in lines[0]


def test_timing_runs_both_products(monkeypatch):
    monkeypatch.setattr(kernel_choice, "COLD_BYTES", 1)  # one copy of the weights
    shape = kernel_choice.LinearShape(128, 256, "uint4", 4, True, "float32")
    xla, kernel = kernel_choice.time_products(shape, 3, "triton", jax.devices()[0], interpret=True)
    assert 0 < xla < 1 and 0 < kernel < 1


def test_decode_rows_and_shapes_the_kernels_refuse():
    assert kernel_choice.decode_rows((1, 2, 16, 64, 128, 512), pp=1) == (1, 2, 16, 64)
    assert kernel_choice.decode_rows((16, 32, 128), pp=2) == (8, 16, 64)  # per microbatch
    groups_of_24 = kernel_choice.LinearShape(96, 128, "int4", 4, False, "bfloat16")
    assert "power of 2" in kernel_choice.unsupported(groups_of_24, "triton")
    assert kernel_choice.unsupported(groups_of_24, "mosaic") is None  # one step over all of K
    assert kernel_choice.unsupported(kernel_choice.LinearShape(4096, 4096, "int8", 1, False, "bfloat16"),
                                     "triton") is None
    assert jnp.dtype(groups_of_24.abstract(2)[1].dtype) == jnp.int4
