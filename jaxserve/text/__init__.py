"""Text: the tokenizer, chat templates (sandboxed) and streaming detokenization. No JAX."""
