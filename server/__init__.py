"""OpenAI-compatible HTTP server over the jaxserve engine."""
