"""Every attention-kernel variant the engine can choose, compiled for the chips it serves on, here.

The engine calls one kernel per platform (Mosaic on a TPU, Triton on a GPU: `pallas_kernels/dispatch.py`)
and each picks its tiles, key blocks and (on a GPU) its split of the keys from a step's static shape
(`ragged_gpu.default_tiles`, `default_kv_splits`; `ragged_tpu`'s block_q). What varies between engines is
the step shape (decode-shaped buckets of 16, 64 or 256 tokens, or buckets holding prefill chunks), the model
(query dtype, head_dim, GQA group, Gemma's soft cap and sliding window, Gemma 3's bidirectional image
spans) and the serve flags (page size, KV page dtype). The cases below cover every value of each at least
once, and each is compiled for TPU v5e and v6e (libtpu: Mosaic's own checks, such as unaligned lane slices
and VMEM limits, run only at compile) and for NVIDIA H100 and H200 (Triton to PTX to ptxas: shared memory
limits, dtype casts). fp8 pages cannot compile for an A100 (sm80), which is why the engine refuses them
there at start.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.dispatch import kernels_for_platform
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, SCALE_DTYPE, scales_shape
from sharding.chips import parse_target
from sharding.compile_only import compile_devices, compile_options

CONTEXT, NUM_PAGES, KV_HEADS = 8192, 2048, 2


@functools.cache
def _case(tokens, seqs, dtype, pages, page_size, head_dim, group, soft_cap=None, window=None, spans=False):
    return dict(tokens=tokens, seqs=seqs, dtype=dtype, pages=pages, page_size=page_size, head_dim=head_dim,
                group=group, soft_cap=soft_cap, window=window, spans=spans)


CASES = {
    "decode16-bf16": _case(16, 16, jnp.bfloat16, "auto", 16, 128, 4),  # GPU: 8 key splits (8192 keys / 1024)
    "decode64-int8-group6": _case(64, 64, jnp.bfloat16, "int8", 16, 128, 6),  # 4 splits; a group not a power of 2
    "decode256-f32-d64": _case(256, 256, jnp.float32, "auto", 16, 64, 2),  # a float32 model; 1 split
    "prefill512-bf16": _case(512, 8, jnp.bfloat16, "auto", 16, 128, 4),  # prefill chunks: wide query tiles
    "prefill256-fp8-d64-mha-page32": _case(256, 8, jnp.bfloat16, "fp8", 32, 64, 1),
    "prefill256-gemma-d256-page64": _case(256, 8, jnp.bfloat16, "auto", 64, 256, 2, 50.0, 4096),
    # Gemma 3 with images: span_ends; its decode buckets too (GPU: split keys), one over int8 pages.
    "prefill256-gemma3-spans-d256": _case(256, 8, jnp.bfloat16, "auto", 16, 256, 2, None, 1024, spans=True),
    "decode16-gemma3-spans-int8": _case(16, 16, jnp.bfloat16, "int8", 16, 128, 4, None, 1024, spans=True),
}
TARGETS = ["v5e-1", "v6e-1", "h100", "h200"]


def _compile(case: dict, target_name: str):
    target = parse_target(target_name)
    device = compile_devices(target)[0]
    backend = kernels_for_platform(target.platform)
    c, shape = case, jax.ShapeDtypeStruct
    page_dtype = KV_CACHE_DTYPES.get(c["pages"], c["dtype"])
    pages = shape((KV_HEADS, NUM_PAGES, c["page_size"], c["head_dim"]), page_dtype)
    scales = {} if c["pages"] == "auto" else {
        "k_scales": shape(scales_shape(KV_HEADS, NUM_PAGES, c["page_size"]), SCALE_DTYPE),
        "v_scales": shape(scales_shape(KV_HEADS, NUM_PAGES, c["page_size"]), SCALE_DTYPE)}
    args = (shape((c["tokens"], KV_HEADS * c["group"], c["head_dim"]), c["dtype"]), pages, pages,
            shape((c["seqs"],), jnp.int32), shape((c["seqs"], CONTEXT // c["page_size"]), jnp.int32),
            shape((c["seqs"] + 1,), jnp.int32))
    spans = {"span_ends": shape((c["tokens"],), jnp.int32)} if c["spans"] else {}
    attend = functools.partial(backend.ragged, sm_scale=c["head_dim"] ** -0.5, soft_cap=c["soft_cap"],
                               sliding_window=c["window"])
    with jax.default_device(device):
        return jax.jit(attend).lower(*args, **scales, **spans).compile(compile_options(target))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_variant_compiles_for_the_chip(case, target):
    compiled = _compile(CASES[case], target)
    text = compiled.as_text()
    assert ("tpu_custom_call" in text) if target.startswith("v") else ("__gpu$xla.gpu.triton" in text)


def test_fp8_pages_do_not_compile_for_an_a100_and_the_engine_refuses_them_at_start(tmp_path):
    with pytest.raises(Exception, match="float8_e4m3fn"):
        _compile(CASES["prefill256-fp8-d64-mha-page32"], "a100")
    from jaxserve.engine.sizing import plan_target
    from jaxserve.engine_args import EngineArgs
    from tests.compile_targets import tiny_config, write_config
    model = write_config(tmp_path / "tiny", tiny_config("llama"))
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8.*compute capability 8.0.*--kv-cache-dtype int8"):
        plan_target(EngineArgs(model=str(model), kv_cache_dtype="fp8"), parse_target("a100"), programs="none")


@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("splits,rows,hidden,scaled", [(8, 16, 4096, False), (8, 64, 8192, True), (1, 1, 2048, False)])
def test_the_decode_epilogue_kernel_compiles_for_the_gpu(target, splits, rows, hidden, scaled):
    """The split products' epilogue (pallas_kernels/residual_norm.py; GPU only): Llama-3-8B's decode step
    (8 shares, 16 rows), a 70B's hidden size at 64 rows with an int8 layer's scales, one unsplit row."""
    from pallas_kernels.residual_norm import residual_rms_norm_gpu
    chip = parse_target(target)
    shape = jax.ShapeDtypeStruct
    args = [shape((splits, rows, hidden), jnp.float32), shape((rows, hidden), jnp.bfloat16),
            shape((hidden,), jnp.bfloat16)]
    epilogue = functools.partial(residual_rms_norm_gpu, eps=1e-5)
    if scaled:
        args.append(shape((hidden,), jnp.float32))
        epilogue = lambda p, r, w, s: residual_rms_norm_gpu(p, r, w, eps=1e-5, column_scale=s)
    with jax.default_device(compile_devices(chip)[0]):
        text = jax.jit(epilogue).lower(*args).compile(compile_options(chip)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("target", ["h100", "h200"])
@pytest.mark.parametrize("tokens,heads,kv_heads,scaled", [(16, 32, 8, False), (64, 64, 8, True), (1, 16, 16, False)])
def test_the_decode_qkv_epilogue_compiles_for_the_gpu(target, tokens, heads, kv_heads, scaled):
    """The split q/k/v product's epilogue (pallas_kernels/qkv_epilogue.py; GPU only), writing the pages in
    place: Llama-3-8B's decode step, a 70B's heads at 64 rows with an int8 layer's scales, one row of MHA."""
    from pallas_kernels.qkv_epilogue import qkv_epilogue_gpu
    chip, shape, head_dim = parse_target(target), jax.ShapeDtypeStruct, 128
    pages = shape((kv_heads, NUM_PAGES, 16, head_dim), jnp.bfloat16)
    args = [shape((8, tokens, (heads + 2 * kv_heads) * head_dim), jnp.float32),
            *[shape((tokens, head_dim // 2), jnp.float32)] * 2, shape((tokens,), jnp.int32), pages, pages]
    scales = [shape((n * head_dim,), jnp.float32) for n in (heads, kv_heads, kv_heads)] if scaled else []
    epilogue = lambda *a: qkv_epilogue_gpu(*a[:6], num_heads=heads, dtype=jnp.bfloat16,
                                           column_scales=a[6:] if scaled else None)
    with jax.default_device(compile_devices(chip)[0]):
        text = jax.jit(epilogue, donate_argnums=(4, 5)).lower(*args, *scales).compile(compile_options(chip)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "output_to_operand_aliasing" in text
    assert " copy(" not in text and "copy-start" not in text  # the pages written where they lie
