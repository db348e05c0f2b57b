"""Run the server: uvicorn around the app, with this project's shutdown and failure policy.

1. `serve` turns on JAX's persistent compilation cache, starts the engine thread (weights and warm-up
   load in the background while `/health` says 503) and runs uvicorn until told to stop.
2. SIGTERM or SIGINT: stop accepting connections and new requests (503), let running requests finish
   for `shutdown_timeout` seconds, then abort the rest, so every stream still ends with a last chunk
   (finish_reason "abort") and `data: [DONE]`; exit 0. A second SIGINT forces an immediate exit.
3. If the engine fails, every waiting request gets an error, `/health` turns 503, and the process exits
   with status 1, so a supervisor (systemd, Kubernetes) restarts it, as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from jaxserve.entrypoints.async_engine import AsyncEngine
from jaxserve.engine_args import EngineArgs
from jaxserve.pooling.config import resolve_runner
from server.app import build_app
from server.http_protocol import uvicorn_config
from server.options import ServerOptions

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 5  # after the abort, how long the aborted streams get to send their last chunks


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache, so a restart's warm-up loads programs instead of compiling."""
    if not directory:
        return
    import jax
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    logger.info("persistent compilation cache: %s", path)


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config, api, shutdown_timeout: float):
            super().__init__(config)
            self.api, self.shutdown_timeout, self.exit_code = api, shutdown_timeout, 0
            self.loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame) -> None:
            # Not uvicorn's: it re-raises the signal after shutting down, which ends the process with the
            # signal's status instead of 0.
            if self.should_exit:
                if sig == signal.SIGINT:
                    self.force_exit = True
                return
            logger.info("%s: draining; running requests get %.0f s to finish", signal.Signals(sig).name,
                        self.shutdown_timeout)
            self.should_exit = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            self.api.draining = True
            self.loop.call_later(self.shutdown_timeout, self._abort_remaining)

        def _abort_remaining(self) -> None:
            aborted = self.api.abort_all()
            if aborted:
                logger.warning("shutdown grace period over: aborted %d running requests", aborted)

        def engine_failed(self) -> None:
            """From the engine thread: its step raised; exit non-zero so a supervisor restarts us."""
            self.exit_code = 1
            if self.loop is not None:
                self.loop.call_soon_threadsafe(setattr, self, "should_exit", True)

    return Server


def serve(args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, compilation_cache_dir: str | None = None,
          options: ServerOptions = ServerOptions()) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or an engine failure (returns 1)."""
    enable_compilation_cache(compilation_cache_dir)
    async_engine = AsyncEngine(args, background_warmup=options.background_warmup)
    app = build_app(async_engine, options)
    config = uvicorn_config(app, options, host=host, port=port,
                            timeout_graceful_shutdown=options.shutdown_timeout + FLUSH_SECONDS)
    server = _uvicorn_server_class()(config, app.state.api, options.shutdown_timeout)
    async_engine.on_failure = server.engine_failed
    async_engine.start()  # loads and compiles in the background; /health says 503 meanwhile
    scheme = "https" if options.ssl_certfile else "http"
    routes = ("/v1/embeddings" if resolve_runner(args.runner, args.model_dir) == "pooling" else
              "/v1/completions, /v1/chat/completions, /v1/responses")
    logger.info("serving on %s://%s:%d%s (OpenAI-compatible: %s)%s", scheme, host, port, options.root_path, routes,
                "; API key required" if options.api_key else "")
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return server.exit_code
