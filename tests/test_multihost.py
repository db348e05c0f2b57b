"""Two processes on 127.0.0.1, 4 fake CPU devices each, form one 8-device mesh through jax.distributed
(gloo collectives) and generate what one device generates.

Process 0 schedules and prints; process 1 follows its steps. Each run is bounded by a timeout and both
process groups are killed whatever happens, so a lone or stuck process cannot hang the suite.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip())
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _start(args: list[str], log: Path, devices: int = 4) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxserve", *args], cwd=ROOT, env=_env(devices),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _distributed(port: int, pid: int) -> list[str]:
    return ["--distributed-coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]


# Two step programs (decodes of both slots, and prefill chunks): each compiles in both processes, for seconds.
MODEL_ARGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--token-buckets", "2,16",
              "--max-model-len", "128"]


def test_two_processes_one_mesh_generate_the_story(stories_dir, story_text, tmp_path):
    prompt = "Once upon a time"
    port = free_port()
    gen = ["generate", "--model", str(stories_dir), "--prompt", prompt, "--max-tokens", "45", *MODEL_ARGS,
           "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [_start(gen + _distributed(port, i), logs[i]) for i in range(2)]
    try:
        deadline = time.monotonic() + TIMEOUT
        for p in procs:
            p.wait(max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("multi-host run timed out:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    finally:
        _kill(procs)
    out = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in out)
    assert "process 1 of 2, 4 local / 8 global devices" in out[1]
    assert "'pipeline': 2, 'tensor': 4" in out[0]
    # One device, same greedy decoding: the documented story (stdout of process 0 only).
    assert story_text[len(prompt):][:60] in out[0]
    assert story_text[len(prompt):][:20] not in out[1]


def test_process_0_serves_http_and_releases_the_follower(stories_dir, story_text, tmp_path):
    port, http_port = free_port(), free_port()
    serve = ["serve", "--model", str(stories_dir), *MODEL_ARGS, "--tensor-parallel-size", "8",
             "--compilation-cache-dir", ""]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [_start(serve + _distributed(port, 0) + ["--port", str(http_port)], logs[0]),
             _start(serve + _distributed(port, 1), logs[1])]
    base = f"http://127.0.0.1:{http_port}"
    try:
        try:
            wait_healthy(base, TIMEOUT, still_alive=lambda: all(p.poll() is None for p in procs))
        except (AssertionError, TimeoutError) as e:
            pytest.fail(f"{e}:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        assert story_text[len("Once upon a time"):].startswith(r.json()["choices"][0]["text"])
        # Stopping process 0 ends the follower too (it is released, not left waiting on a collective).
        os.killpg(procs[0].pid, signal.SIGTERM)
        procs[0].wait(60)
        procs[1].wait(60)
        assert procs[1].returncode == 0, logs[1].read_text()[-3000:]
    finally:
        _kill(procs)
