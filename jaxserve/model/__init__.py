"""Model definitions: the decoder families as Flax NNX modules (Llama-style in `llama.py`, Gemma 2 / 3 in
`gemma.py`, mixtures of experts in `moe.py`, on the shared skeleton of `decoder.py`), their registry, and
the paged KV storage their attention layers write to. Loading weights into them is `jaxserve/loader/`."""
