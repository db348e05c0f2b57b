"""End to end: stories260K through the engine with the Pallas kernels (interpret mode on CPU) gives the
same greedy tokens as the dense jnp reference and as the blocked jnp default, prompts batched together
in ragged steps that mix a long prefill with a running decode."""

import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels import CPU_FLAVOUR_ENV

PROMPTS = ["Once upon a time", "The cat sat on the mat and looked at the big red ball in the park"]
# Two step programs per engine (both decodes, and prefill chunks): in interpret mode each compiles for long.
SMALL = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, token_buckets=(2, 16), page_size=8)


def greedy(llm):
    params = SamplingParams(temperature=0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def reference_tokens(stories_dir):
    llm = LLM(str(stories_dir), attention_backend="reference", **SMALL)
    assert llm.engine.runner.attention.name == "reference (jnp, dense)"
    return greedy(llm)


@pytest.mark.parametrize("flavour", ["triton", "mosaic"])
def test_pallas_kernels_reproduce_reference_tokens(stories_dir, stories_llm, reference_tokens, monkeypatch,
                                                   flavour):
    monkeypatch.setenv(CPU_FLAVOUR_ENV, flavour)
    llm = LLM(str(stories_dir), attention_backend="pallas", **SMALL)
    assert llm.engine.runner.attention.name == f"pallas-{flavour} (interpret)"
    assert greedy(llm) == reference_tokens
    assert stories_llm.engine.runner.attention.name == "blocked (jnp)"
    assert greedy(stories_llm) == reference_tokens
