"""jaxserve: LLM inference in JAX with a paged KV cache, continuous batching and Pallas attention."""

from jaxserve.engine import CompletionOutput, Engine, RequestOutput
from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineArgs", "RequestOutput", "CompletionOutput"]
