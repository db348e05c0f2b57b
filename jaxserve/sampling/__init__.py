"""Sampling: a request's sampling parameters, the on-device sampler and logits processing (penalties,
biases, masks, log-probabilities), and grammars for structured outputs."""
