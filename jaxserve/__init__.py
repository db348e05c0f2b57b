"""jaxserve: LLM inference in JAX with a paged KV cache, continuous batching and Pallas attention."""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version as _version
from typing import TYPE_CHECKING

try:
    __version__ = _version("jaxserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"

# The public names load on first use: `import jaxserve` alone must not import JAX, so that tools that
# only talk HTTP (`jaxserve bench serve`, `jaxserve --help`) start in a fraction of a second and a load
# generator does not carry the engine's heap while it measures.
_EXPORTS = {"LLM": "jaxserve.llm", "SamplingParams": "jaxserve.sampling", "Engine": "jaxserve.engine",
            "EngineArgs": "jaxserve.engine_args", "RequestOutput": "jaxserve.engine",
            "CompletionOutput": "jaxserve.engine"}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from jaxserve.engine import CompletionOutput, Engine, RequestOutput
    from jaxserve.engine_args import EngineArgs
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
