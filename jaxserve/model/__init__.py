"""Model definitions: the decoder families as Flax NNX modules, their registry, and the paged KV storage
their attention layers write to. Loading weights into them is `jaxserve/loader/`."""
