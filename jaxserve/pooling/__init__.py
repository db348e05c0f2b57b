"""Pooling: embeddings from the same ragged step that generates, with no sampling (`--runner pooling`).

1. At start, `config.py` decides the runner (`--runner auto` follows vLLM: a sentence-transformers model
   or an architecture named `...Model` embeds) and the `PoolerConfig`: the pooling type (last token, mean,
   CLS) and normalization from the model's sentence-transformers files and then `--pooler-config`, the
   Matryoshka sizes from its `config.json`.
2. Such an engine's steps end in the pool head (`jaxserve/execution/heads/pool.py`) where a generating
   engine's draw: each sequence row's share of the step is pooled on the device (`device.py`): the hidden
   state of its last or first token, or the sum of its tokens, one float32 row per sequence in fixed
   shapes.
3. On the host, the pool head's update folds each row into its request (`params.PooledPrompt`): a prompt
   longer than one step's budget arrives in chunks, and mean pooling adds them up. The chunk that ends
   the prompt finishes the request: the vector is cut to the requested `dimensions`, normalized when
   asked, and returned as an `EmbeddingRequestOutput`.
No JAX outside `device.py`: the server and the CLI read the configuration without loading the engine.
"""
