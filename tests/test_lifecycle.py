"""The server's ends: SIGTERM drains and exits 0 without cutting a stream (defect 7 of the hostile-client
issue), and an engine failure fails every waiting request cleanly and exits non-zero for a supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.server_harness import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}


def start_server(stories_dir, tmp_path, *extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve", "serve", "--model", str(stories_dir),
                             "--port", str(port), "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                             "--compilation-cache-dir", "", *extra], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 240, still_alive=lambda: proc.poll() is None)
    except BaseException:
        proc.kill()
        raise AssertionError((tmp_path / "serve.log").read_text()[-3000:]) from None
    return proc, base


def stream_events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


@pytest.mark.parametrize("grace, finish", [("30", "length"), ("0", "abort")])
def test_defect7_sigterm_drains_streams_and_exits_0(stories_dir, tmp_path, grace, finish):
    """With a grace period the running stream completes; without one it is ended with finish_reason
    "abort". Either way it gets its last chunk and `data: [DONE]`, and the process exits with status 0."""
    proc, base = start_server(stories_dir, tmp_path, "--shutdown-timeout", grace)
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=LONG, timeout=120) as response:
            events = stream_events(response)
            first = json.loads(next(events))
            assert first["choices"][0]["finish_reason"] is None
            proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in rest[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == finish
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        with pytest.raises(httpx.TransportError):  # gone: it no longer accepts connections
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_engine_failure_fails_every_request_and_exits_nonzero(stories_dir, monkeypatch):
    from jaxserve.engine_args import EngineArgs
    from jaxserve.execution.runner import ModelRunner
    from server.options import ServerOptions
    from server.serve import serve

    broken = threading.Event()
    launch = ModelRunner.launch

    def failing_launch(self, plan, *args, **kwargs):
        # Once broken, the first step in which both requests decode raises: each is then mid-generation,
        # whichever reached the server first (the plain one's sender is a thread of its own).
        if broken.is_set() and sum(not seq.is_prefill for seq in plan.seqs) == 2:
            raise RuntimeError("device lost: secret internal detail")
        return launch(self, plan, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "launch", failing_launch)
    port = free_port()
    result = {}
    args = EngineArgs(model=str(stories_dir), max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32))
    thread = threading.Thread(target=lambda: result.setdefault("code", serve(
        args, port=port, compilation_cache_dir="", options=ServerOptions(shutdown_timeout=1))), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 240)
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200

    replies = {}

    def plain():
        replies["plain"] = httpx.post(f"{base}/v1/completions", json={**LONG, "stream": False}, timeout=60)

    sender = threading.Thread(target=plain)
    sender.start()
    with httpx.stream("POST", f"{base}/v1/completions", json=LONG, timeout=60) as response:
        events = stream_events(response)
        next(events)
        broken.set()  # 400 tokens each: both are decoding long before either ends
        rest = list(events)
    sender.join(60)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "server_error" and "internal error" in error["message"]
    assert replies["plain"].status_code == 500
    assert "secret" not in replies["plain"].text and "request id" in replies["plain"].json()["error"]["message"]
    thread.join(60)
    assert result["code"] == 1  # the process would exit non-zero: a supervisor restarts it
