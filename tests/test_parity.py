"""Numerical parity with Hugging Face transformers (float32) on small random configs.

The golden logits were produced by `tools/make_parity_fixtures.py` (see tests/fixtures/parity/README.md):
a 48-token prompt plus 16 greedy tokens, and the full-sequence logits. Here the prompt goes through
`prefill` in chunks and the rest through `decode` over the paged cache; every logit must agree within
1e-4 and the greedy tokens must be identical.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import CacheConfig, ModelConfig, SchedulerConfig
from jaxserve.kv_cache import PageAllocator, pages_needed
from jaxserve.runner import ModelRunner, SlotSampling
from jaxserve.sharded_model import load_sharded
from pallas_kernels.dispatch import select_attention_backend
from sharding import ParallelConfig, make_plan

FIXTURES = Path(__file__).parent / "fixtures" / "parity"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden.npz").is_file())
PAGE_SIZE = 8


def test_every_supported_model_type_has_a_fixture():
    types = {ModelConfig.from_pretrained(FIXTURES / c).model_type for c in CASES}
    assert types == {"llama", "mistral", "qwen2", "qwen3"}


@pytest.mark.parametrize("case", CASES)
def test_prefill_then_decode_matches_transformers(case):
    golden = np.load(FIXTURES / case / "golden.npz")
    ids, prompt_len, ref_logits = golden["input_ids"].tolist(), int(golden["prompt_len"]), golden["logits"]
    config = ModelConfig.from_pretrained(FIXTURES / case)
    plan = make_plan(ParallelConfig(), num_layers=config.num_layers, num_heads=config.num_heads,
                     num_kv_heads=config.num_kv_heads)
    model = load_sharded(FIXTURES / case, config, jnp.float32, plan)
    slots = 3
    runner = ModelRunner(model, config, CacheConfig(page_size=PAGE_SIZE, num_pages=32),
                         SchedulerConfig(max_num_seqs=slots, max_model_len=128, prefill_buckets=(16, 32)),
                         select_attention_backend("reference"), jnp.float32)
    # A shuffled, non-contiguous page list, so page-table indexing is really exercised.
    allocator = PageAllocator(32)
    pages = allocator.allocate(pages_needed(128, PAGE_SIZE) + 4)[::-1][:pages_needed(128, PAGE_SIZE)]

    # Prefill in two chunks: 32 tokens then 16, crossing page boundaries with a cached prefix.
    _, logits_a = runner.prefill(ids[:32], 0, pages, SlotSampling(), all_logits=True)
    first, logits_b = runner.prefill(ids[32:prompt_len], 32, pages, SlotSampling(), all_logits=True)
    np.testing.assert_allclose(np.concatenate([logits_a, logits_b]), ref_logits[:prompt_len], atol=1e-4, rtol=0)
    assert first == ids[prompt_len]

    generated = [first]
    for position in range(prompt_len, len(ids) - 1):
        # The sequence sits in the middle slot; the others are idle.
        tokens, logits = runner.decode([None, (generated[-1], position, pages, SlotSampling()), None],
                                       with_logits=True)
        np.testing.assert_allclose(logits[1], ref_logits[position], atol=1e-4, rtol=0)
        generated.append(int(tokens[1]))
    assert generated == ids[prompt_len:]
