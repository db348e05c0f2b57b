"""The pooling runner offline (`LLM.embed`): embeddings of the random Qwen3 embedding fixture against the
goldens transformers made (tests/fixtures/embedding/README.md), in mixed batches with chunked prompts and
no compilation after warm-up; the pooler config read from sentence-transformers files; the refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from jaxserve.errors import InvalidParameter, WrongRunner
from jaxserve.pooling.config import PoolerConfig, parse_pooler_overrides, resolve_runner
from jaxserve.pooling.params import PooledPrompt, PoolingParams
from tests.embedding_model import ENGINE_KWARGS, FIXTURE, as_text, golden, golden_prompts, servable_copy
from tests.page_checks import assert_pages_released

TOLERANCE = 1e-4  # the fixture README's, for float32


@pytest.fixture(scope="module")
def embed_llm(tmp_path_factory):
    from jaxserve import LLM
    return LLM(str(servable_copy(tmp_path_factory.mktemp("embed"))), **ENGINE_KWARGS)  # runner "auto"


def _vectors(outputs) -> np.ndarray:
    return np.array([o.embedding for o in outputs], np.float32)


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def test_auto_runner_pools_with_the_sentence_transformers_config(embed_llm):
    engine = embed_llm.engine
    assert engine.runner_type == "pooling"
    assert (engine.pooling.pooler_config.pooling_type, engine.pooling.pooler_config.normalize) == ("LAST", True)
    assert not engine.model_config.has_lm_head


def test_embeddings_match_the_goldens_in_mixed_chunked_batches(embed_llm):
    g = golden()
    prompts = golden_prompts()  # 4, 11, 23 and 40 tokens: the last two span several 16-token steps
    first = [o.embedding for o in embed_llm.embed(prompts)]  # the model's pooler: last token, normalized
    np.testing.assert_allclose(first, g["last_token_normalized"], atol=TOLERANCE, rtol=0)
    cases = {
        "last_token": PoolingParams(normalize=False),
        "mean": PoolingParams(pooling_type="MEAN", normalize=False),
        "mean_normalized": PoolingParams(pooling_type="MEAN"),
        "cls": PoolingParams(pooling_type="CLS", normalize=False),
    }
    expected = dict(g, cls=g["hidden_states"][:, 0])
    # Every kind in one call: rows of different kinds and lengths share each step, in a shuffled order.
    order = [(key, i) for key in cases for i in range(4)]
    order = [order[j] for j in np.random.default_rng(0).permutation(len(order))]
    stats = embed_llm.engine.stats
    steps_before, seqs_before = stats.steps, stats.step_sequences
    outputs = embed_llm.embed([prompts[i] for _, i in order], [cases[key] for key, _ in order])
    for (key, i), out in zip(order, outputs):
        np.testing.assert_allclose(out.embedding, expected[key][i], atol=TOLERANCE, rtol=0, err_msg=f"{key} {i}")
        assert out.prompt_token_ids == prompts[i] and out.finished
    assert stats.step_sequences - seqs_before > stats.steps - steps_before  # batched: requests shared steps
    assert embed_llm.engine.compilations_since_warmup == 0


def test_text_inputs_and_prefix_cache(embed_llm):
    g = golden()
    prompt = golden_prompts()[3]
    again = embed_llm.embed([as_text(prompt), prompt])  # the same tokens, as text and as ids
    np.testing.assert_allclose(_vectors(again), [g["last_token_normalized"][3]] * 2, atol=TOLERANCE, rtol=0)
    assert again[1].num_cached_tokens > 0  # last-token pooling reuses cached prefix pages...
    mean = embed_llm.embed(prompt, PoolingParams(pooling_type="MEAN", normalize=False))[0]
    assert mean.num_cached_tokens == 0  # ...mean pooling needs every token's hidden state
    np.testing.assert_allclose(mean.embedding, g["mean"][3], atol=TOLERANCE, rtol=0)
    assert embed_llm.engine.compilations_since_warmup == 0


def test_bad_requests_are_refused_before_anything_runs(embed_llm):
    from jaxserve import SamplingParams
    with pytest.raises(WrongRunner, match="--runner generate"):
        embed_llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidParameter, match="Matryoshka") as e:
        embed_llm.embed([[3, 4, 5]], PoolingParams(dimensions=8))
    assert e.value.param == "dimensions"
    with pytest.raises(InvalidParameter, match="context length"):
        embed_llm.embed([[3] * 65])
    with pytest.raises(InvalidParameter, match="vocabulary"):
        embed_llm.embed([[3, 400]])
    with pytest.raises(InvalidParameter):
        PoolingParams(pooling_type="MAX")
    assert embed_llm.embed([[3] * 64])[0].finished  # a prompt as long as the context fits: nothing is generated
    assert not embed_llm.engine.has_unfinished()


def test_an_aborted_embedding_frees_everything(embed_llm):
    engine = embed_llm.engine
    request_id = engine.pooling.add(golden_prompts()[3])  # 40 tokens: three steps
    outputs = engine.step()
    engine.abort(request_id)
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(request_id, "abort")]
    assert_pages_released(engine.scheduler)


def test_generate_runner_refuses_embeddings():
    from jaxserve.engine.engine import Engine
    from jaxserve.engine_args import EngineArgs
    engine = Engine(EngineArgs(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32))  # the default, no warm-up
    assert engine.runner_type == "generate"
    with pytest.raises(WrongRunner, match="--runner pooling"):
        engine.pooling.add([3, 4, 5])


# ---- configuration (no engine) ---------------------------------------------------------------------------

def _st_dir(tmp_path, pooling: dict, modules=("Transformer", "Pooling", "Normalize"), config: dict | None = None):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": paths[m], "type": f"sentence_transformers.models.{m}"}
         for i, m in enumerate(modules)]))
    (tmp_path / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    return tmp_path


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    assert PoolerConfig.for_model(FIXTURE) == PoolerConfig("LAST", True, hidden_size=64, max_seq_length=256)
    mean = _st_dir(tmp_path, {"pooling_mode_mean_tokens": True, "include_prompt": True},
                   modules=("Transformer", "Pooling"))
    assert PoolerConfig.for_model(mean) == PoolerConfig("MEAN", False)
    assert resolve_runner("auto", mean) == "pooling"  # modules.json, even with a causal-LM architecture
    assert PoolerConfig.for_model(mean, '{"pooling_type": "cls", "normalize": true}') == PoolerConfig("CLS", True)


def test_pooler_config_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        PoolerConfig.for_model(_st_dir(tmp_path, {"pooling_mode_max_tokens": True}))
    for bad in ('{"pooling_type": "MAX"}', '{"softmax": true}', "{not json", '{"normalize": "yes"}'):
        with pytest.raises(ValueError):
            parse_pooler_overrides(bad)


def test_runner_resolution(tmp_path):
    assert resolve_runner("auto", FIXTURE) == "pooling"  # "architectures": ["Qwen3Model"]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert resolve_runner("auto", tmp_path) == "generate"
    assert resolve_runner("pooling", tmp_path) == "pooling"
    assert resolve_runner("auto", None) == "generate"
    with pytest.raises(ValueError, match="runner"):
        resolve_runner("embed", tmp_path)


def test_matryoshka_dimensions_cut_before_normalizing(tmp_path):
    config = PoolerConfig.for_model(_st_dir(tmp_path, {"pooling_mode_lasttoken": True},
                                            config={"hidden_size": 8, "matryoshka_dimensions": [4, 8]}))
    assert config.matryoshka and config.matryoshka_dimensions == (4, 8)
    for bad in (3, 16, 0):
        with pytest.raises(InvalidParameter, match="dimensions"):
            config.check_dimensions(bad)
    pooled = PooledPrompt.resolve(PoolingParams(dimensions=4), config)
    row = np.arange(8, dtype=np.float32)
    pooled.add(row, first_chunk=True, start=0, last_chunk=True)
    np.testing.assert_allclose(pooled.finish(5), _normalized(row[:4]), rtol=1e-6)


def test_mean_pooling_sums_chunks_and_starts_over_on_recomputation():
    pooled = PooledPrompt.resolve(PoolingParams(pooling_type="MEAN", normalize=False), PoolerConfig())
    pooled.add(np.full(2, 100.0, np.float32), first_chunk=True, start=0, last_chunk=False)  # then preempted
    pooled.add(np.full(2, 3.0, np.float32), first_chunk=True, start=0, last_chunk=False)
    pooled.add(np.full(2, 5.0, np.float32), first_chunk=False, start=3, last_chunk=True)
    np.testing.assert_allclose(pooled.finish(4), [2.0, 2.0])


def test_checkpoint_with_model_prefix_and_lm_head_loads_as_the_bare_one(tmp_path):
    """Embedding models saved from the causal-LM class name tensors `model.*` and may carry an LM head:
    the pooling runner loads them as it loads the bare decoder (no head)."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.config import ModelConfig
    from jaxserve.loader.load import load_sharded
    from sharding import ParallelConfig, make_plan

    tensors = load_file(FIXTURE / "model.safetensors")
    prefixed = {f"model.{name}": value for name, value in tensors.items()}
    prefixed["lm_head.weight"] = np.ones((256, 64), np.float32)
    shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
    save_file(prefixed, tmp_path / "model.safetensors")
    config = dataclasses.replace(ModelConfig.from_pretrained(FIXTURE), has_lm_head=False)
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    bare, wrapped = (load_sharded(d, config, np.float32, plan) for d in (FIXTURE, tmp_path))
    for a, b in zip(*(jax_leaves(m.params) for m in (bare, wrapped))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def test_serve_flags_reach_the_engine_args():
    from jaxserve.entrypoints.args import engine_args_from
    from jaxserve.entrypoints.cli import build_parser

    argv = ["serve", str(FIXTURE), "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}']
    args = engine_args_from(build_parser().parse_args(argv))
    assert (args.runner, args.pooler_config) == ("pooling", '{"pooling_type": "MEAN"}')
    with pytest.raises(ValueError, match="pooling_type"):  # before any model is loaded
        engine_args_from(build_parser().parse_args(argv[:-1] + ['{"pooling_type": "MAX"}']))
