"""Run a real uvicorn server on 127.0.0.1 in a background thread, for end-to-end tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from jaxserve.entrypoints.async_engine import AsyncEngine
from jaxserve.engine_args import EngineArgs
from server.app import build_app
from server.http.connection import uvicorn_config
from server.options import ServerOptions


# The engine the server tests share (given `model=`): two step programs, a decode of every slot and the whole
# budget. Modules that use the same sizes compile them once per run and load them from the run's cache after
# that (tests/conftest.py), instead of compiling one program per power-of-two bucket each.
SHARED_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(8, 64))


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """`r` is an error in OpenAI's shape with `status` (and `param`, when given); returns its body."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float, still_alive=lambda: True) -> None:
    """Poll `base`/health until it answers 200; fail early when `still_alive()` turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert still_alive(), "the server process died while starting"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base} did not become healthy within {timeout}s")


class Running(tuple):
    """(base URL, AsyncEngine); `.context` is the app's ServingContext, for tests that look inside."""
    context = None


@contextlib.contextmanager
def running_server(args: EngineArgs, ready_timeout: float = 300, options: ServerOptions = ServerOptions()):
    async_engine = AsyncEngine(args)
    async_engine.start()
    port = free_port()
    app = build_app(async_engine, options)
    server = uvicorn.Server(uvicorn_config(app, options, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, ready_timeout)
        running = Running((base, async_engine))
        running.context = app.state.context
        running.app = app
        yield running
    finally:
        server.should_exit = True
        thread.join(10)
        async_engine.shutdown()


def scrape(base: str) -> dict[str, float]:
    """/metrics as {sample name: value}, label-free samples only."""
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
