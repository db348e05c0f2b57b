"""Benchmarks users run: `jaxserve bench serve` against any OpenAI-compatible server, `latency` and
`throughput` offline through `LLM`."""
