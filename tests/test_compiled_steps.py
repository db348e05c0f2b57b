"""The engine's step programs compiled for the chips it serves on, here, by their own compilers.

`jaxserve plan`'s machinery (jaxserve/engine/sizing.py) builds each engine from a config.json alone (weights
as shapes on a mesh of compile-only devices: sharding/compile_only.py) and compiles its decode program for
TPU v5e / v6e (libtpu) or NVIDIA H200 (XLA:GPU with ptxas): each family (dense with n-gram speculation and
with LoRA, Gemma 2, a mixture of experts) on one chip or under tensor parallelism over 4 (v6e-4 = v6e:2x2,
h200x4), tensor x pipeline (v6e-4 as 2 x 2), and a multi-host slice (v5e-16: 16 chips on 4 hosts, 4 x 4). From each program's `memory_analysis()`:
1. the KV pool and the sampler state are donated: the program's outputs alias them (updated in place);
2. no temp buffer is as large as one layer's pages on a device: a cache copied per layer (what XLA did on
   TPU while the page write and the Mosaic kernel wanted different layouts) cannot hide in the temp bytes;
3. temp bytes stay under TEMP_BOUND: a decode step of these models needs activations of a few kB a token.
The pool (4096 pages of 16 tokens) is far larger than anything else the programs hold, so a copy of it
shows. One program each keeps this file within about two minutes of the suite's time here.
A Gemma 3 vision checkpoint's step (its image rows placed at the image tokens, which attend to each other
through the attention kernel's span ends: Triton on H200, Mosaic on v6e) and its vision encoder's programs
compile for both chips too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxserve.config import SpeculativeConfig
from jaxserve.engine.images import encoder_batch_sizes
from jaxserve.engine.sizing import plan_target, step_programs
from jaxserve.engine_args import EngineArgs
from sharding.chips import parse_target
from tests.compile_targets import HEADS, tiny_config, write_config

NUM_PAGES, PAGE_SIZE = 4096, 16
GEMMA3_VISION = Path(__file__).resolve().parent / "fixtures" / "vlm" / "gemma3"
TEMP_BOUND = 8 << 20  # bytes per device, the decode program's temp buffers

CASES = {
    # name: (family, target, pipeline stages, extra engine options). Features share programs where they can:
    # each program costs 15-40 s of this machine's compile time.
    "speculative-v6e": ("llama", "v6e-1", 1, {"speculative_config": SpeculativeConfig("ngram", 4, 2, 4)}),
    "lora-h200": ("llama", "h200", 1, {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}),
    "gemma2-v5e": ("gemma2", "v5e-1", 1, {}),
    "moe-tp4-h200": ("qwen3_moe", "h200x4", 1, {}),
    "tp4-v6e": ("llama", "v6e-4", 1, {}),
    "tp2-pp2-v6e": ("llama", "v6e-4", 2, {}),
    "tp4-pp4-v5e-16-multihost": ("llama", "v5e-16", 4, {}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {family: write_config(root / family, tiny_config(family, num_hidden_layers=4) if family == "llama"
                                 else tiny_config(family))
            for family in ("llama", "gemma2", "qwen3_moe")}


@pytest.mark.parametrize("case", list(CASES))
def test_step_program_compiles_for_the_chip_with_the_cache_in_place(case, model_dirs):
    family, target_name, stages, options = CASES[case]
    target = parse_target(target_name)
    args = EngineArgs(model=str(model_dirs[family]), num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=4,
                      max_model_len=512, token_buckets=(16,), max_num_batched_tokens=16,
                      pipeline_parallel_size=stages, **options)
    plan = plan_target(args, target, programs="decode")
    program, = plan.programs
    mesh = plan.built.model.plan
    assert (mesh.tp, mesh.pp) == (target.chips // stages, stages)
    assert plan.built.attention.name == ("pallas-mosaic" if target.chip.is_tpu else "pallas-triton")

    vocab = plan.built.model_config.vocab_size
    sampler_state_bytes = (args.max_num_seqs + 1) * vocab * (4 + 1)  # int32 counts and bool flags, replicated
    kv_pool = plan.footprint.kv_pool
    assert kv_pool == NUM_PAGES * PAGE_SIZE * plan.kv_bytes_per_token
    assert program.alias_bytes >= kv_pool + sampler_state_bytes, "KV pool or sampler state not donated"

    one_layers_pages = kv_pool // (2 * mesh.layers_per_stage)  # K (or V) of one layer, on one device
    assert program.temp_bytes < one_layers_pages, f"{program.temp_bytes} temp bytes: a layer's pages copied?"
    assert program.temp_bytes <= TEMP_BOUND


@pytest.fixture(scope="module")
def gemma3_vision_dir(tmp_path_factory):
    """The tiny Gemma 3 fixture's config with TPU-sized attention heads (its vision tower as it is)."""
    config = json.loads((GEMMA3_VISION / "config.json").read_text())
    config["text_config"].update(HEADS, hidden_size=256, intermediate_size=512, query_pre_attn_scalar=128)
    return write_config(tmp_path_factory.mktemp("configs") / "gemma3", config)


@pytest.mark.parametrize("target_name", ["h200", "v6e-1"])
def test_a_gemma3_vision_step_and_its_encoder_compile_for_the_chip(target_name, gemma3_vision_dir):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.execution.vision import VisionEncoderProgram
    from jaxserve.model.siglip import Gemma3VisionEncoder
    from jaxserve.vision_config import vision_config
    from sharding.compile_only import compile_devices, compile_options

    target = parse_target(target_name)
    args = EngineArgs(model=str(gemma3_vision_dir), dtype="bfloat16", num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                      max_num_seqs=4, max_model_len=512, token_buckets=(32,), max_num_batched_tokens=32)
    plan = plan_target(args, target, programs="decode")
    program, = plan.programs
    rows = step_programs(plan.built, args).image_rows
    assert rows is not None and rows.spans and rows.rows_per_step == 32  # two images of 16 tokens a step
    assert plan.built.attention.name == ("pallas-mosaic" if target.chip.is_tpu else "pallas-triton")
    assert program.alias_bytes >= plan.footprint.kv_pool, "KV pool not donated"
    assert program.temp_bytes <= TEMP_BOUND

    # The encoder: its programs (1 and 2 images a call under this budget) for the same chip, the projector's
    # rows as wide as the text model's hidden size, in its dtype.
    config = vision_config(json.loads((gemma3_vision_dir / "config.json").read_text()))
    encoder = VisionEncoderProgram(Gemma3VisionEncoder(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                                   (config.num_channels, config.image_size, config.image_size), jnp.bfloat16,
                                   device=jax.devices("cpu")[0], buckets=encoder_batch_sizes(2))
    device = compile_devices(target)[0]
    for bucket in encoder.buckets:
        with jax.default_device(device):
            lowered = encoder.lower(bucket, device)
            lowered.compile(compile_options(target))
        assert (lowered.out_info.shape, lowered.out_info.dtype) == ((bucket, 16, 256), jnp.bfloat16)
