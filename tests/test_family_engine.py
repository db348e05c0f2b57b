"""The issue-29 families through the whole engine (`LLM`: scheduler, chunked prefill, continuous batching,
the engine's own prefix cache): the golden prompt generates transformers' 64 greedy tokens alone, beside
another request, and again from the prefix cache."""

from pathlib import Path

import numpy as np
import pytest

from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.loader.convert import convert
from jaxserve.model.feature_major import FeatureMajorLinear
from jaxserve.model.moe import Experts, SplitExperts

FIXTURES = Path(__file__).parent / "fixtures" / "parity"


@pytest.mark.parametrize("case", ["gemma3_text", "mixtral"])
def test_engine_greedy_matches_transformers_generate(case, id_tokenizer):
    golden = np.load(FIXTURES / case / "golden.npz")
    prompt, want = golden["input_ids"][:int(golden["prompt_len"])].tolist(), golden["greedy"].tolist()
    # 16-token chunks: the 48-token prompt prefills over three steps, beside the other request's decodes.
    llm = LLM(str(FIXTURES / case), tokenizer=str(id_tokenizer), max_num_seqs=2, max_model_len=128,
              max_num_batched_tokens=16, token_buckets=(2, 16), page_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    if case == "mixtral":  # a one-device CPU engine holds the experts apart (jaxserve/model/moe.py)
        module = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
        kinds = {type(node) for _, node in nnx.iter_graph(module)}
        assert SplitExperts in kinds and Experts not in kinds
    first, other = llm.generate([prompt, prompt[:20] + [7, 9, 11]], greedy)
    assert first.outputs[0].token_ids == want
    again = llm.generate([prompt], greedy)[0]
    assert again.num_cached_tokens == 40  # five full pages of the prompt from the prefix cache
    assert again.outputs[0].token_ids == want


@pytest.mark.parametrize("library", ["auto", "ynnpack-feature-major"])
def test_a_mapped_mixture_of_experts_serves_transformers_tokens_with_its_experts_apart(tmp_path, id_tokenizer,
                                                                                        library):
    """A mapped checkpoint's stacks lie in the file; the engine splits them into arrays of its own, and copies
    the rest so that the mapping goes (jaxserve/loader/placement.py's `split_experts`): same greedy tokens.
    With feature-major products, from the model's own layout, the kernels turn and the experts split in one
    pass (`feature_major(..., experts_apart=True)`)."""
    golden = np.load(FIXTURES / "mixtral" / "golden.npz")
    prompt, want = golden["input_ids"][:int(golden["prompt_len"])].tolist(), golden["greedy"].tolist()
    mapped = convert(FIXTURES / "mixtral", tmp_path / "mapped", "float32", format="mapped", linear_layout="model")
    llm = LLM(str(mapped), tokenizer=str(id_tokenizer), max_num_seqs=2, max_model_len=128,
              max_num_batched_tokens=16, token_buckets=(2, 16), page_size=8, cpu_matmul_library=library)
    module = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    kinds = {type(node) for _, node in nnx.iter_graph(module)}
    assert SplitExperts in kinds and Experts not in kinds
    assert (FeatureMajorLinear in kinds) == (library == "ynnpack-feature-major")
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == want
