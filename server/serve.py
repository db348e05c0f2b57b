"""Run the server: uvicorn around the app, with this project's shutdown and failure policy.

1. `serve` binds the port (`http/listen.py`: a port in use is refused before anything loads), turns on JAX's
   persistent compilation cache, starts the engine thread (weights and warm-up load in the background
   while `/health` says 503) and runs uvicorn on the bound sockets until told to stop.
2. SIGTERM or SIGINT: stop accepting connections and new requests (503), let running requests finish
   for `shutdown_timeout` seconds, then abort the rest, so every stream still ends with a last chunk
   (finish_reason "abort") and `data: [DONE]`; exit 0. A second SIGINT forces an immediate exit.
3. If the engine fails, every waiting request gets an error, `/health` turns 503, and the process exits
   with status 1, so a supervisor (systemd, Kubernetes) restarts it, as vLLM does.
4. If it fails before it is ready (a bad config, tokenizer or weights file, out of memory at warm-up), the
   server stops however far uvicorn has got, even before it runs, and `serve` raises the reason (the
   file or option to change), which the command line prints as its last line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl

from jaxserve.engine_args import EngineArgs
from jaxserve.entrypoints.async_engine import AsyncEngine
from jaxserve.pooling.config import resolve_runner
from server.app import build_app
from server.http.connection import uvicorn_config
from server.http.listen import listen
from server.options import ServerOptions
from server.serving.context import ServingContext

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
        def __init__(self, config, ctx: ServingContext, shutdown_timeout: float):
            super().__init__(config)
            self.ctx, self.shutdown_timeout, self.exit_code = ctx, shutdown_timeout, 0
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
            self.ctx.admission.drain()
            self.loop.call_later(self.shutdown_timeout, self._abort_remaining)

        def _abort_remaining(self) -> None:
            aborted = self.ctx.engine.abort_all()
            if aborted:
                logger.warning("shutdown grace period over: aborted %d running requests", aborted)

        def engine_failed(self) -> None:
            """From the engine thread, at any time, even before `run`: exit non-zero (a supervisor restarts
            us). `should_exit` is state, not an event: uvicorn reads it once its start-up is done and on
            every tick of its main loop (10 a second), so it is seen however early it is set. (A call
            posted to the server's event loop was lost when the engine failed before the loop existed.)"""
            self.exit_code = 1
            self.should_exit = True

    return Server


def serve(args: EngineArgs, host: str = "127.0.0.1", port: int = 8000, compilation_cache_dir: str | None = None,
          options: ServerOptions = ServerOptions()) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or an engine failure while serving (returns 1). Raises when the
    server cannot start: `ListenError` when it cannot listen, the engine's start error (see
    `AsyncEngine.start_error`) when the engine fails before it is ready."""
    routes = ("/v1/embeddings" if resolve_runner(args.runner, args.model_dir) == "pooling" else
              "/v1/completions, /v1/chat/completions, /v1/responses")
    async_engine = AsyncEngine(args, background_warmup=options.background_warmup)
    app = build_app(async_engine, options)
    config = uvicorn_config(app, options, host=host, port=port,
                            timeout_graceful_shutdown=options.shutdown_timeout + FLUSH_SECONDS)
    try:
        config.load()  # reads the TLS files: a bad one is refused before the engine starts loading
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {options.ssl_certfile} / --ssl-keyfile {options.ssl_keyfile}: not a "
                         f"PEM certificate and its private key ({e.reason or e})") from None
    sockets = listen(host, port, config.backlog)
    try:
        enable_compilation_cache(compilation_cache_dir)
        server = _uvicorn_server_class()(config, app.state.context, options.shutdown_timeout)
        async_engine.on_failure = server.engine_failed  # before the thread starts: no failure goes unheard
        async_engine.start()  # loads and compiles in the background; /health says 503 meanwhile
        logger.info("serving on %s://%s:%d%s (OpenAI-compatible: %s)%s", "https" if options.ssl_certfile else "http",
                    host, sockets[0].getsockname()[1], options.root_path, routes,
                    "; API key required" if options.api_key else "")
        server.run(sockets=sockets)
    finally:
        async_engine.shutdown()
        for sock in sockets:
            sock.close()
    if async_engine.start_error is not None:
        raise async_engine.start_error
    if server.exit_code:
        logger.error("exiting with status %d: the engine failed while serving (%s)", server.exit_code,
                     async_engine.error)
    return server.exit_code
