"""What runs a CPU step's matrix products (`--cpu-matmul-library`, jaxserve/execution/cpu_matmuls.py): the
choice per model, that it reaches the compiled step programs, and that it changes no token."""

import argparse
import dataclasses
import re

import jax.numpy as jnp
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import LinearQuantization, ModelConfig
from jaxserve.entrypoints.args import add_engine_args, engine_args_from
from jaxserve.engine.builder import smallest_token_bucket, token_buckets_for
from jaxserve.execution.cpu_matmuls import EIGEN_FROM_HIDDEN, FEATURE_MAJOR, compiler_options, resolve_cpu_matmuls


def _config(hidden: int, quantized: bool = False) -> ModelConfig:
    config = ModelConfig(model_type="llama", vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=64)
    spec = LinearQuantization(codes="int8", strategy="dynamic_int8") if quantized else None
    return dataclasses.replace(config, linear_quantization=spec)


def test_auto_takes_feature_major_products_for_float32_models_from_the_threshold_up():
    big, small = _config(EIGEN_FROM_HIDDEN), _config(64)
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.float32) == FEATURE_MAJOR
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.float32, devices=2) == "eigen"  # needs one device
    # a mapped checkpoint's weights stay where they lie: turning them would copy the model at every start
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.float32, weights_in_place=True) == "eigen"
    # ... unless the file stores them turned already (`jaxserve convert --format mapped` on a CPU)
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.float32, weights_in_place=True,
                               stored_turned=True) == FEATURE_MAJOR
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.float32, devices=2, stored_turned=True) == "eigen"
    assert resolve_cpu_matmuls(FEATURE_MAJOR, "cpu", big, jnp.float32, weights_in_place=True) == FEATURE_MAJOR
    assert resolve_cpu_matmuls("auto", "cpu", small, jnp.float32) == "ynnpack"  # attention's tiny products
    assert resolve_cpu_matmuls("auto", "cpu", big, jnp.bfloat16) == "ynnpack"
    # int8 x int8 products run fast in YNNPACK only: per channel and per row, with their codes turned
    int8 = _config(EIGEN_FROM_HIDDEN, quantized=True)
    assert resolve_cpu_matmuls("auto", "cpu", int8, jnp.float32) == FEATURE_MAJOR
    blocked = dataclasses.replace(int8, linear_quantization=dataclasses.replace(int8.linear_quantization, act_block=32))
    assert resolve_cpu_matmuls("auto", "cpu", blocked, jnp.float32) == "ynnpack"
    assert resolve_cpu_matmuls("auto", "cpu", _config(64, quantized=True), jnp.float32) == "ynnpack"
    assert resolve_cpu_matmuls("eigen", "cpu", small, jnp.float32) == "eigen"
    assert resolve_cpu_matmuls("auto", "tpu", big, jnp.float32) is None  # an XLA:CPU option only
    assert compiler_options(None) == compiler_options("ynnpack") == {}
    with pytest.raises(ValueError, match="cpu_matmul_library"):
        resolve_cpu_matmuls("mkl", "cpu", big, jnp.float32)


def test_a_jaxlib_without_the_option_keeps_its_default(monkeypatch, caplog):
    from jaxserve.execution import cpu_matmuls
    monkeypatch.setattr(cpu_matmuls, "EIGEN_DOTS", {"xla_cpu_no_such_option": "1"})
    cpu_matmuls._xla_knows_the_option.cache_clear()
    try:
        assert resolve_cpu_matmuls("eigen", "cpu", _config(64), jnp.float32) == "ynnpack"
        assert "matrix products stay in its default library" in caplog.text
    finally:
        cpu_matmuls._xla_knows_the_option.cache_clear()


def test_the_flag_reaches_the_engine_args():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).cpu_matmul_library == "auto"
    assert engine_args_from(parser.parse_args(["--cpu-matmul-library", "eigen"])).cpu_matmul_library == "eigen"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cpu-matmul-library", "mkl"])


def _dots_in_ynnpack(llm, bucket: int) -> int:
    compiler = llm.engine.runner.compiler
    text = compiler._compiled[compiler.layouts[bucket]].as_text()
    return sum(1 for line in text.splitlines()
               if "__ynn_fusion" in line and re.search(r'op_name="[^"]*dot_general', line))


def test_eigen_step_programs_have_no_ynnpack_products_and_give_the_same_tokens(stories_dir, stories_llm):
    # stories260K's `auto` is YNNPACK (the suite's shared engine); forced to Eigen, its products leave YNNPACK.
    eigen = LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(64,),
                cpu_matmul_library="eigen")
    assert _dots_in_ynnpack(stories_llm, 64) > 0 and _dots_in_ynnpack(eigen, 64) == 0
    prompts = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park to", ""]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    assert ([o.outputs[0].token_ids for o in eigen.generate(prompts, greedy)] ==
            [o.outputs[0].token_ids for o in stories_llm.generate(prompts, greedy)])
    assert eigen.engine.compilations_since_warmup == 0


def test_bfloat16_engines_on_a_cpu_compile_no_one_token_bucket(stories_dir, stories_llm):
    """XLA:CPU runs a one-row bfloat16 product in its own loop (the 124.7M model's one-token step: 102-108 ms
    against 21-22 ms for two tokens), so a bfloat16 engine's default buckets start at two tokens and a lone
    decode runs padded. float32, other backends and buckets a user names keep one-token steps."""
    assert smallest_token_bucket("cpu", jnp.bfloat16) == 2
    assert smallest_token_bucket("cpu", jnp.float32) == smallest_token_bucket("tpu", jnp.bfloat16) == 1
    # on a GPU a one-token bf16 step ran slower than a 16-token one (H200, docs/performance.md)
    assert smallest_token_bucket("gpu", jnp.bfloat16) == smallest_token_bucket("gpu", jnp.float16) == 16
    assert smallest_token_bucket("gpu", jnp.float32) == 1
    assert token_buckets_for(8, jnp.float32) == (1, 2, 4, 8)
    assert token_buckets_for(8, jnp.bfloat16) == (2, 4, 8)
    assert token_buckets_for(1, jnp.bfloat16) == (1,)  # a one-token budget keeps its only bucket
    bf16 = LLM(str(stories_dir), dtype="bfloat16", max_num_seqs=2, max_num_batched_tokens=8)
    assert bf16.engine.scheduler_config.token_buckets == (2, 4, 8)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    tokens = bf16.generate(["Once upon a time"], greedy)[0].outputs[0].token_ids
    assert len(tokens) == 24 and bf16.engine.compilations_since_warmup == 0
    # bfloat16 weights round stories260K's float32 ones: the story begins as float32's does
    assert tokens[:8] == stories_llm.generate(["Once upon a time"], greedy)[0].outputs[0].token_ids[:8]
