"""jaxserve: LLM inference in JAX with a paged KV cache, continuous batching and Pallas attention.

The public API is what this module exports; the subpackages are the engine's rooms, from the top down:
`entrypoints` (LLM, Workbench, the CLI, the async engine a server drives), `engine` (the loop and its
assembly), `speculative` (draft proposers for speculative decoding), `scheduling` (request state, the scheduler, the step description, KV pages and the prefix
cache, and `update_from_output`), `execution` (the device batch, the compiled step, the runner),
`sampling` (sampling parameters, the sampler, logits processing, grammars) and `lora` (LoRA adapters: reading,
device slots, the term the projections add), `model` and `loader`
(model definitions, checkpoints onto the mesh), `multimodal` (images in requests: loading them with
their guards, preprocessing as each checkpoint's processor does), `text` (tokenizer, chat templates,
detokenizer) and `bench`. Imports only point down this list (`tests/test_import_graph.py` checks it). `pooling` (the
pooling runner's config, in-step pooling and parameters) imports only leaf modules, so any room may use it.
"""

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
_EXPORTS = {"LLM": "jaxserve.entrypoints.llm", "SamplingParams": "jaxserve.sampling.params",
            "Workbench": "jaxserve.entrypoints.research", "Engine": "jaxserve.engine.engine",
            "EngineArgs": "jaxserve.engine_args", "RequestOutput": "jaxserve.outputs",
            "CompletionOutput": "jaxserve.outputs", "PoolingParams": "jaxserve.pooling.params",
            "EmbeddingRequestOutput": "jaxserve.pooling.params", "LoRARequest": "jaxserve.lora.request"}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from jaxserve.engine.engine import Engine
    from jaxserve.engine_args import EngineArgs
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.entrypoints.research import Workbench
    from jaxserve.lora.request import LoRARequest
    from jaxserve.outputs import CompletionOutput, RequestOutput
    from jaxserve.pooling.params import EmbeddingRequestOutput, PoolingParams
    from jaxserve.sampling.params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
