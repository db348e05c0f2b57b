"""End to end: stories260K through the engine with the Pallas kernels (interpret mode on CPU) gives the
same greedy tokens as with the reference attention."""

import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels import CPU_FLAVOUR_ENV


@pytest.mark.parametrize("flavour", ["triton", "mosaic"])
def test_pallas_kernels_reproduce_reference_tokens(stories_dir, stories_llm, monkeypatch, flavour):
    monkeypatch.setenv(CPU_FLAVOUR_ENV, flavour)
    prompts = ["Once upon a time", "The cat sat on the mat and looked at the big red ball in the park"]
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(str(stories_dir), attention_backend="pallas", max_num_seqs=2, max_model_len=64,
              prefill_buckets=(16,), page_size=8)
    assert llm.engine.runner.attention.name == f"pallas-{flavour} (interpret)"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in stories_llm.generate(prompts, params)]
    assert stories_llm.engine.runner.attention.name == "reference (jnp)"
    assert got == want
