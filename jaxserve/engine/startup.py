"""Start-up failures said in one line: what failed and which option or file to change.

1. A bad file or option is already reported where it is found, as a ValueError / OSError naming it: the
   config (`config.py`), the tokenizer (`text/tokenizer.py`), the weights (`loader/`), the mesh
   (`sharding/`), the KV budget (`execution/kv_budget.py`). Those pass through here untouched.
2. `start_phase` wraps the two phases of a start, building the engine (weights on the device, the KV page
   pool) and warm-up (compiling the step programs): the failures that come from the device or the compiler
   instead, whose own text names neither an option nor a file, become `EngineStartError`:
   - out of device memory: the options that size what did not fit (weights, KV cache, step activations);
   - a compilation that failed at warm-up: the options that change what is compiled.
   The original stays the error's cause, with its traceback. Anything else (a bug) propagates as it is.
3. `reported` is what a caller that ran the start elsewhere (the server's engine thread) tells its user.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

from jaxserve.engine_args import EngineArgs
from jaxserve.errors import ACTIONABLE_ERRORS, EngineStartError

F = TypeVar("F", bound=Callable)

BUILD = "loading the model"  # weights onto the mesh, the KV page pool
WARMUP = "warm-up (compiling the step programs)"
_RUNTIME_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")  # jax's name for a failure of XLA, by version


def _out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(". ")


def reported(error: Exception) -> Exception:
    """What a caller that could not start the engine tells its user: `error` itself when its message says
    what to change, else an `EngineStartError` that names it and points at its logged traceback."""
    if isinstance(error, ACTIONABLE_ERRORS):
        return error
    return EngineStartError(f"the engine failed to start: {type(error).__name__}: {_first_line(error)} "
                            f"(the traceback is above)")


def explain(error: Exception, phase: str, args: EngineArgs | None) -> EngineStartError | None:
    """The one-line reason for `error` raised during `phase`, or None when it needs no translation."""
    if isinstance(error, ACTIONABLE_ERRORS):
        return None  # already names the file or option
    first_line = _first_line(error)
    if _out_of_memory(error):
        return EngineStartError(f"out of device memory during {phase}: {first_line}. "
                                f"{_memory_advice(phase, args or EngineArgs())}")
    if phase == WARMUP and type(error).__name__ in _RUNTIME_ERRORS:
        return EngineStartError(f"compiling a step program failed: {first_line}. --attention-backend reference "
                                f"compiles without the Pallas kernels; fewer --token-buckets or a smaller "
                                f"--max-num-batched-tokens compile fewer, smaller programs")
    return None


def _memory_advice(phase: str, args: EngineArgs) -> str:
    kv_sized_by = ("--gpu-memory-utilization" if args.gpu_memory_utilization is not None else
                   "--kv-cache-memory" if args.kv_cache_memory is not None else
                   "--num-pages" if args.num_pages is not None else
                   f"--max-num-seqs ({args.max_num_seqs}) x --max-model-len")
    kv = f"a smaller KV cache (now sized by {kv_sized_by})"
    if phase == BUILD:
        return (f"Make the weights smaller (--quantization int8, or --tensor-parallel-size N across devices) "
                f"or ask for {kv}")
    budget = args.max_num_batched_tokens or "default"
    return (f"Leave the step programs more room: {kv}, or a smaller --max-num-batched-tokens (now {budget}), "
            f"which sizes a step's activations")


def start_phase(phase: str) -> Callable[[F], F]:
    """Decorates an `Engine` method that is one phase of a start (`BUILD` or `WARMUP`)."""
    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapped(engine, *args, **kwargs):
            try:
                return method(engine, *args, **kwargs)
            except Exception as e:
                reason = explain(e, phase, getattr(engine, "args", None))
                if reason is None:
                    raise
                raise reason from e
        return wrapped  # type: ignore[return-value]
    return decorate
