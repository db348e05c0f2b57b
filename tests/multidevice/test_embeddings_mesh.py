"""The pooling runner on a mesh: tensor and pipeline parallel embeddings match the transformers goldens."""

import numpy as np

from jaxserve import LLM, PoolingParams
from tests.embedding_model import golden, golden_prompts, servable_copy


def test_embeddings_on_a_tensor_and_pipeline_parallel_mesh(tmp_path):
    # The fixture's 4 heads, 2 KV heads and 2 layers split 2 x 2; a one-bucket engine of its own shapes.
    llm = LLM(str(servable_copy(tmp_path)), max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,),
              page_size=4, num_pages=96, max_model_len=64, tensor_parallel_size=2, pipeline_parallel_size=2)
    g, prompts = golden(), golden_prompts()
    last = [o.embedding for o in llm.embed(prompts)]
    mean = [o.embedding for o in llm.embed(prompts, PoolingParams(pooling_type="MEAN", normalize=False))]
    np.testing.assert_allclose(last, g["last_token_normalized"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(mean, g["mean"], atol=1e-4, rtol=0)
    assert llm.engine.compilations_since_warmup == 0
