"""What the request handlers are given: the serving context (`context.py`) and its parts, each with a
narrow interface: the engine client (`engine_client.py`: readiness, the one check of a request, running
and aborting requests), the served model (`model.py`: name, limits, tokenizer, LoRA adapters), admission
(`admission.py`: the queue limit and draining) and the Prometheus metrics (`metrics.py`)."""
