"""Entry points over the engine: `LLM` (offline), `Workbench` (research), the command line, and the async
engine a server drives."""
