"""jaxserve: LLM inference in JAX with a paged KV cache, continuous batching and Pallas attention."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("jaxserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"

from jaxserve.engine import CompletionOutput, Engine, RequestOutput
from jaxserve.engine_args import EngineArgs
from jaxserve.llm import LLM
from jaxserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineArgs", "RequestOutput", "CompletionOutput", "__version__"]
