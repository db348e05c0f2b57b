"""A GPU decode step's split products and their one-kernel epilogues (issue 52): the Pallas kernels (residual +
RMSNorm; q/k/v rope and KV write) against their `jnp` references (interpret mode), the split's shape rules, and
a tiny model's layers run fused against the plain ones (float and int8 weight-only). The kernels compiled for
H100 / H200: test_compiled_kernels.py; the step's kernels a layer: test_program_profile.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.config import LinearQuantization, ModelConfig
from jaxserve.model import split_k
from jaxserve.model.kv_cache import KVCache
from jaxserve.model.linear_kernels import KernelPlan
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.quantized_linear import quantize_linears
from jaxserve.model.split_k import DecodeEpilogues, split_partials, splits, takes
from pallas_kernels.qkv_epilogue import qkv_epilogue_gpu, qkv_epilogue_reference
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.residual_norm import fits, residual_rms_norm_gpu, residual_rms_norm_reference


def _arrays(seed, splits_, rows, hidden, dtype):
    rng = np.random.default_rng(seed)
    partials = jnp.asarray(rng.standard_normal((splits_, rows, hidden)), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    weight = jnp.asarray(rng.standard_normal(hidden), dtype)
    scale = jnp.asarray(rng.random(hidden) + 0.5, jnp.float32)
    return partials, residual, weight, scale


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 1, 64), (4, 3, 256), (8, 2, 128)])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_kernel_is_its_reference(dtype, shape, scaled):
    partials, residual, weight, scale = _arrays(sum(shape), *shape, dtype)
    scale = scale if scaled else None
    got = residual_rms_norm_gpu(partials, residual, weight, eps=1e-5, column_scale=scale, interpret=True)
    want = residual_rms_norm_reference(partials, residual, weight, eps=1e-5, column_scale=scale)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype
        # Same roundings in the same order; float32 sums may differ in their last bit.
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=1e-6)
    # And the reference is what the plain layer computes: (x + product) then RMSNorm.
    x = (residual.astype(jnp.float32) + (partials.sum(0) * (1 if scale is None else scale)).astype(dtype)
         .astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(want[0], np.float32), np.asarray(x, np.float32))


def test_without_a_norm_the_reference_only_adds():
    partials, residual, _, _ = _arrays(0, 2, 3, 64, jnp.bfloat16)
    x, normed = residual_rms_norm_reference(partials, residual, None, eps=0.0)
    assert normed is None and x.shape == residual.shape


def test_shapes_the_kernel_refuses():
    assert fits(4096, 8) and fits(16, 1) and not fits(3072, 8) and not fits(4096, 3) and not fits(32768, 8)
    partials, residual, weight, _ = _arrays(0, 3, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="power-of-2"):
        residual_rms_norm_gpu(partials, residual, weight, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        residual_rms_norm_gpu(partials[:2], residual[:, :32], weight, eps=1e-5, interpret=True)


def _qkv_case(seed, splits_, tokens, heads, kv_heads, head_dim, pages=5, page_size=8):
    rng = np.random.default_rng(seed)
    partials = jnp.asarray(rng.standard_normal((splits_, tokens, (heads + 2 * kv_heads) * head_dim)), jnp.float32)
    angles = rng.random((tokens, head_dim // 2)) * 6
    slots = rng.permutation(np.arange(page_size, pages * page_size))[:tokens]  # distinct, past the null page
    k_pages = jnp.asarray(rng.standard_normal((kv_heads, pages, page_size, head_dim)), jnp.bfloat16)
    return (partials, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32),
            jnp.asarray(slots, jnp.int32), k_pages, -k_pages)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("splits_,tokens,heads,kv_heads,head_dim", [(4, 3, 4, 2, 16), (1, 1, 2, 2, 32), (2, 5, 8, 1, 16)])
def test_the_qkv_epilogue_is_its_reference(scaled, splits_, tokens, heads, kv_heads, head_dim):
    case = _qkv_case(tokens, splits_, tokens, heads, kv_heads, head_dim)
    rng = np.random.default_rng(0)
    scales = tuple(jnp.asarray(rng.random(n * head_dim) + 0.5, jnp.float32) for n in (heads, kv_heads, kv_heads))
    scales = scales if scaled else None
    got = qkv_epilogue_gpu(*case, num_heads=heads, dtype=jnp.bfloat16, column_scales=scales, interpret=True)
    want = qkv_epilogue_reference(*case, num_heads=heads, dtype=jnp.bfloat16, column_scales=scales)
    assert got[0].shape == (tokens, heads, head_dim) and got[0].dtype == jnp.bfloat16
    for g, w in zip(got, want):  # q, then the pages: the written rows and every other row as it was
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-6, atol=1e-6)
    written = np.asarray(got[1], np.float32).reshape(kv_heads, -1, head_dim)[:, np.asarray(case[3])]
    assert not np.allclose(written, np.asarray(case[4], np.float32).reshape(kv_heads, -1, head_dim)[:, np.asarray(case[3])])


def test_the_qkv_epilogue_refuses_what_it_cannot_hold():
    partials, cos, sin, slots, k_pages, v_pages = _qkv_case(0, 2, 3, 4, 2, 16)
    with pytest.raises(ValueError, match="do not hold"):
        qkv_epilogue_gpu(partials, cos, sin, slots, k_pages, v_pages, num_heads=3, dtype=jnp.bfloat16, interpret=True)
    partials, cos, sin, slots, k_pages, v_pages = _qkv_case(0, 2, 3, 6, 2, 16)
    with pytest.raises(ValueError, match="power-of-2 head counts"):  # (compiled; interpret mode takes any)
        qkv_epilogue_gpu(partials, cos, sin, slots, k_pages, v_pages, num_heads=6, dtype=jnp.bfloat16)


def test_splits_fill_the_multiprocessors_and_keep_deep_shares():
    assert splits(4096, 4096) == 8  # o_proj of Llama-3-8B: 32 column tiles x 8 shares (XLA picked 8 too)
    assert splits(14336, 4096) == 8  # down_proj
    assert splits(512, 4096) == 2  # shares of at least MIN_SHARE rows
    assert splits(4096, 32768) == 1  # enough column tiles already
    assert splits(4097, 4096) == 1  # odd: no share count divides it
    assert DecodeEpilogues().applies(64) and not DecodeEpilogues().applies(65)


CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
PAGES, PAGE_SIZE = 9, 16


@functools.cache
def _model(dtype_name: str, quantized: bool):
    dtype = jnp.dtype(dtype_name)
    model = LlamaForCausalLM(CONFIG, dtype=dtype, rngs=nnx.Rngs(0))
    if quantized:  # random codes and per-channel scales in place of a checkpoint's
        model = quantize_linears(model, LinearQuantization(codes="int8", strategy="weight_only"))
        rng = np.random.default_rng(1)
        for path, param in nnx.iter_graph(model):
            if path and path[-1] == "codes":
                param[...] = jnp.asarray(rng.integers(-127, 128, param.shape), jnp.int8)
            elif path and path[-1] == "scales":
                param[...] = jnp.asarray(rng.random(param.shape) * 0.002, jnp.float32)
    rng = np.random.default_rng(2)
    for path, param in nnx.iter_graph(model):  # norms of unit scale hide a wrong weight: make them random
        if path and path[-1] == "weight" and "layernorm" in path[-2]:
            param[...] = jnp.asarray(rng.random(param.shape) + 0.5, dtype)
    return model


def _step(model, fused: bool, rows: int = 4):
    """run_layers over a decode step of `rows` sequences of 5-20 tokens (pages filled with random K/V)."""
    rng = np.random.default_rng(3)
    dtype = model.embed_tokens.embedding.value.dtype
    shape = (CONFIG.num_kv_heads, PAGES, PAGE_SIZE, CONFIG.head_dim)
    pages = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2 * CONFIG.num_layers)]
    cache = KVCache(pages[::2], pages[1::2], num_layers=CONFIG.num_layers)
    kv_lens = jnp.asarray(rng.integers(5, 2 * PAGE_SIZE, rows), jnp.int32)
    page_tables = jnp.asarray(1 + np.arange(rows * 2).reshape(rows, 2), jnp.int32)
    last = kv_lens - 1  # each sequence's new token, written at its slot before attention reads it
    write_index = page_tables[jnp.arange(rows), last // PAGE_SIZE] * PAGE_SIZE + last % PAGE_SIZE
    cu_q_lens = jnp.arange(rows + 1, dtype=jnp.int32)

    def attend(q, k_pages, v_pages, first_page):
        return ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_tables + first_page, cu_q_lens,
                                                sm_scale=CONFIG.head_dim ** -0.5)

    graphdef, state = nnx.split(model)
    if fused:
        module = nnx.merge(graphdef, state)
        module.decode_epilogues = DecodeEpilogues(interpret=True)
        graphdef, state = nnx.split(module)

    @jax.jit
    def run(state, x):
        m = nnx.merge(graphdef, state)
        cos, sin = m.rope(kv_lens - 1)
        return m.run_layers(x, cos, sin, cache, write_index, attend)

    x = jnp.asarray(rng.standard_normal((rows, CONFIG.hidden_size)), dtype)
    return run(state, x)


@pytest.mark.parametrize("dtype_name,quantized", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
def test_fused_layers_are_the_plain_layers(dtype_name, quantized):
    model = _model(dtype_name, quantized)
    layers = list(model.layers)
    assert all(layer.takes_split() and split_k.takes_qkv(layer.self_attn) for layer in layers)
    (x_plain, cache_plain), (x_fused, cache_fused) = _step(model, False), _step(model, True)
    # float32: the split sums in another order; bf16: a rounding of the residual may fall the other way, and
    # the next layers carry it (bf16's step is 1/128 of a value's magnitude).
    tol = 1e-5 if dtype_name == "float32" else 3e-2
    for fused, plain in zip([x_fused, *cache_fused.k, *cache_fused.v], [x_plain, *cache_plain.k, *cache_plain.v]):
        fused, plain = np.asarray(fused, np.float32), np.asarray(plain, np.float32)
        assert np.abs(fused - plain).max() <= tol * np.abs(plain).max()


def test_split_partials_sum_to_the_product():
    model = _model("float32", False)
    o_proj = model.layers[0].self_attn.o_proj
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, CONFIG.q_size)), jnp.float32)
    partials, scale = split_partials(o_proj, x)
    assert scale is None and partials.shape == (splits(CONFIG.q_size, CONFIG.hidden_size), 3, CONFIG.hidden_size)
    np.testing.assert_allclose(partials.sum(0), o_proj(x), rtol=1e-5, atol=1e-5)


def test_what_the_split_takes():
    model = _model("bfloat16", True)
    down = model.layers[0].mlp.down_proj
    assert takes(down) and takes(_model("float32", False).layers[0].mlp.down_proj)
    assert not takes(nnx.Linear(8, 8, use_bias=True, rngs=nnx.Rngs(0)))
    grouped = quantize_linears(LlamaForCausalLM(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                               LinearQuantization(codes="int8", strategy="weight_only", block_size=32))
    assert not takes(grouped.layers[0].mlp.down_proj)  # per-group scales: XLA's product
    dynamic = quantize_linears(LlamaForCausalLM(CONFIG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                               LinearQuantization(codes="int8", strategy="dynamic_int8"))
    assert not takes(dynamic.layers[0].mlp.down_proj)
    # A layer whose product a Pallas kernel runs (a KernelPlan set at start) keeps it.
    down.kernel = KernelPlan("triton", (64,), (True,))
    try:
        assert not takes(down)
    finally:
        down.kernel = None


def test_only_a_gpu_engine_s_unrolled_llama_takes_the_epilogues():
    from jaxserve.engine.decode_epilogues import choose_decode_epilogues
    from jaxserve.loader.placement import ShardedModel

    def sharded(config=CONFIG, repeats=1):
        graphdef, params = nnx.split(LlamaForCausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
        return ShardedModel(plan=None, config=config, graphdef=graphdef, params=params, dtype=jnp.bfloat16,
                            layer_repeats=repeats)

    epilogues = lambda model: nnx.merge(model.graphdef, model.params).decode_epilogues
    plain = sharded()
    assert choose_decode_epilogues(plain, "cpu") is plain and choose_decode_epilogues(plain, "tpu") is plain
    assert epilogues(choose_decode_epilogues(plain, "gpu")) == DecodeEpilogues()
    assert epilogues(choose_decode_epilogues(sharded(repeats=3), "gpu")) is None  # scanned layers: the plain ones
    assert epilogues(choose_decode_epilogues(sharded(dataclasses.replace(CONFIG, o_proj_bias=True)), "gpu")) is None
