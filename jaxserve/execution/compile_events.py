"""Compilations counted per engine, from JAX's monitoring events.

JAX reports every lowering (each new jitted shape is one) and every persistent-cache hit through
process-wide listeners. One listener is installed per process; it credits each event to the
`CompileEvents` that the reporting thread is working for (`counting`), so several engines in one
process (tests, notebooks) each count their own, and warm-up's compilations, which may go on in a
background thread while the engine serves, are counted apart from the ones a step had to make.
"""

from __future__ import annotations

import contextlib
import threading

_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class _Current(threading.local):
    events: CompileEvents | None = None
    warmup: bool = False


_current = _Current()
_install_lock = threading.Lock()
_installed = False


class CompileEvents:
    def __init__(self):
        self.lowered = 0  # outside warm-up: what a step had to compile
        self.lowered_in_warmup = 0
        self.cache_hits = 0  # persistent compilation cache hits
        self.program_cache_hits = 0  # executables loaded without tracing (counted by the compiler)
        self._lock = threading.Lock()
        _install()

    @contextlib.contextmanager
    def counting(self, warmup: bool | None = None):
        """Credit this thread's compilations to these counters: as warm-up's with `warmup`; with None, as
        the enclosing `counting` of these counters does (a step run by the calibration that ends warm-up is
        warm-up's), else as a step's."""
        previous = _current.events, _current.warmup
        if warmup is None:
            warmup = previous[0] is self and previous[1]
        _current.events, _current.warmup = self, warmup
        try:
            yield
        finally:
            _current.events, _current.warmup = previous

    def loaded_from_program_cache(self) -> None:
        with self._lock:
            self.program_cache_hits += 1

    def _record(self, event: str) -> None:
        with self._lock:
            if event == _LOWERED:
                if _current.warmup:
                    self.lowered_in_warmup += 1
                else:
                    self.lowered += 1
            elif event == _CACHE_HIT:
                self.cache_hits += 1


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        import jax

        def on_event(event: str, *_, **__) -> None:
            if event in (_LOWERED, _CACHE_HIT) and _current.events is not None:
                _current.events._record(event)

        jax.monitoring.register_event_duration_secs_listener(on_event)
        jax.monitoring.register_event_listener(on_event)
        _installed = True
