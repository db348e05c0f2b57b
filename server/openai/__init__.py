"""The OpenAI-compatible endpoints and vLLM's extensions of them: completions, chat completions,
embeddings, /tokenize and /detokenize, and the runtime LoRA routes; their request bodies (`protocol.py`)
and the JSON shapes of what they answer (`output_json.py`)."""
