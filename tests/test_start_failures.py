"""A server (or `LLM`, `generate`, `bench`) that cannot start says why in one line and exits, however early
it fails (issue 55).

1. Broken copies of stories260K in a temporary folder: an unknown model_type, a config.json that is not
   JSON, no tokenizer, a truncated model.safetensors, a config whose sizes the weights do not have; and a
   port already in use. Each command runs as its own process, several at once: every one must exit
   non-zero within 30 s with a last stderr line naming the file or option, and no traceback.
2. The race behind it, in process: the engine failing before uvicorn runs, and while it serves 503.
3. What only the device or the compiler can report (out of memory, a failed compilation) becomes a line
   naming the options to change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from jaxserve.engine_args import EngineArgs
from jaxserve.errors import EngineStartError
from tests.server_harness import free_port

ROOT = Path(__file__).resolve().parents[1]
BOUND_SECONDS = 30

# case -> (command after `python -m jaxserve`, with {dir} a broken model folder and {port} a port;
#          what the last stderr line must say)
CASES = {
    "unknown_model_type": ("serve {unknown_type} --port {port}",
                           r"model_type 'mamba' in \S+/config\.json is not supported \(supported: llama"),
    "malformed_config": ("serve {bad_json} --port {port}", r"\S+/config\.json is not valid JSON: line 3 column 1"),
    "no_tokenizer": ("serve {no_tokenizer} --port {port}", r"no tokenizer\.json in \S+: .*pass --tokenizer DIR"),
    "truncated_weights": ("serve {truncated} --port {port}",
                          r"\S+/model\.safetensors is truncated: its header describes \d+ bytes of tensor data but "
                          r"the file holds \d+"),
    "shape_mismatch": ("serve {wider_mlp} --port {port}",
                       r"weight 'model\.layers\.0\.mlp\.\w+_proj\.weight' in \S+/model\.safetensors has shape "
                       r"\(\d+, \d+\) but \S+/config\.json implies"),
    "port_in_use": ("serve {good} --port {busy_port}", r"port {busy_port} is in use on 127\.0\.0\.1 \(pass --port"),
}


def broken_copies(stories_dir: Path, root: Path) -> dict[str, Path]:
    """{name: folder}: stories260K copied, each copy broken in one way."""
    def copy(name: str) -> Path:
        folder = root / name
        shutil.copytree(stories_dir, folder)
        for file in folder.iterdir():
            file.chmod(0o644)  # the shared models are read-only
        return folder

    def edit_config(folder: Path, **changes) -> Path:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | changes))
        return folder

    folders = {"good": stories_dir,
               "unknown_type": edit_config(copy("unknown_type"), model_type="mamba",
                                 architectures=["MambaForCausalLM"]),
               "wider_mlp": edit_config(copy("wider_mlp"), intermediate_size=256)}
    (copy("bad_json") / "config.json").write_text('{\n  "model_type": "llama",\n}\n')  # a trailing comma
    folders["bad_json"] = root / "bad_json"
    folders["no_tokenizer"] = copy("no_tokenizer")
    for file in folders["no_tokenizer"].glob("tokenizer*"):
        file.unlink()
    folders["truncated"] = copy("truncated")
    weights = folders["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])  # an interrupted download
    return folders


@pytest.fixture(scope="module")
def outcomes(stories_dir, tmp_path_factory) -> dict[str, dict]:
    """Every case run at once (as many at a time as there are cores): {case: rc, seconds, stderr}."""
    folders = broken_copies(stories_dir, tmp_path_factory.mktemp("broken"))
    with socket.socket() as busy:  # another process's server on that port, as far as jaxserve can tell
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        names = {**folders, "busy_port": busy.getsockname()[1]}
        env = dict(os.environ, JAX_PLATFORMS="cpu")

        def run(case: str) -> dict:
            command = CASES[case][0].format(**names, port=free_port()).split()
            if command[0] == "serve":
                command += ["--compilation-cache-dir", ""]
            start = time.monotonic()
            try:
                done = subprocess.run([sys.executable, "-m", "jaxserve", *command], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=90)
                rc, stderr = done.returncode, done.stderr
            except subprocess.TimeoutExpired as e:  # the defect: a server that never exits
                rc, stderr = None, (e.stderr or b"").decode(errors="replace")
            return {"rc": rc, "seconds": time.monotonic() - start, "stderr": stderr, "names": names}

        with ThreadPoolExecutor(max_workers=min(len(CASES), max(2, os.cpu_count() or 2))) as pool:
            return dict(zip(CASES, pool.map(run, CASES)))


@pytest.mark.parametrize("case", list(CASES))
def test_a_server_that_cannot_start_says_why_and_exits(outcomes, case):
    outcome = outcomes[case]
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    context = "\n".join(lines[-15:])
    assert outcome["rc"] not in (0, None), f"rc {outcome['rc']}:\n{context}"
    assert outcome["seconds"] < BOUND_SECONDS, context
    assert lines[-1].startswith("jaxserve: error: "), context
    assert re.search(CASES[case][1].format(**outcome["names"]), lines[-1]), context
    assert "Traceback" not in outcome["stderr"], context  # the line is the whole story


# ---- the race, in process ------------------------------------------------------------------------------


def serve_in_thread(monkeypatch, engine_factory, synchronous_start: bool = False):
    """Run `serve` with `engine_factory` in place of `Engine`; returns (thread, {"error" or "code"}, base)."""
    from jaxserve.entrypoints import async_engine
    from server.options import ServerOptions
    from server.serve import serve

    monkeypatch.setattr(async_engine, "Engine", engine_factory)
    if synchronous_start:  # the engine fails and reports it before uvicorn has even created its event loop
        monkeypatch.setattr(async_engine.AsyncEngine, "start", lambda self: self._run())
    port = free_port()
    result: dict = {}

    def target():
        try:
            result["code"] = serve(EngineArgs(), port=port, compilation_cache_dir="",
                                   options=ServerOptions(shutdown_timeout=1))
        except Exception as e:  # noqa: BLE001 - the test looks at it
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result, f"http://127.0.0.1:{port}"


def refuse(message: str, kind=ValueError):
    def engine(args):
        raise kind(message)
    return engine


def test_an_engine_failing_before_uvicorn_runs_still_stops_the_server(monkeypatch):
    thread, result, _ = serve_in_thread(monkeypatch, refuse("tokenizer.json is broken"), synchronous_start=True)
    thread.join(BOUND_SECONDS)
    assert not thread.is_alive(), "the server kept running after its engine failed"
    assert isinstance(result.get("error"), ValueError) and str(result["error"]) == "tokenizer.json is broken"


def test_an_engine_failing_while_the_server_answers_503_stops_it(monkeypatch):
    go = threading.Event()

    def engine(args):
        go.wait(BOUND_SECONDS)
        raise RuntimeError("a bug")

    thread, result, base = serve_in_thread(monkeypatch, engine)
    deadline = time.monotonic() + BOUND_SECONDS
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 503:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    go.set()
    thread.join(BOUND_SECONDS)
    assert not thread.is_alive(), "the server kept running after its engine failed"
    error = result.get("error")  # not a ValueError: a bug, whose traceback the log has
    assert isinstance(error, EngineStartError), result
    assert str(error) == "the engine failed to start: RuntimeError: a bug (the traceback is above)"


def test_a_port_in_use_is_refused_before_anything_loads(monkeypatch):
    from server.http.listen import ListenError, listen

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ListenError, match=f"port {port} is in use on 127.0.0.1 \\(pass --port"):
            listen("127.0.0.1", port, 16)
    with pytest.raises(ListenError, match="--host 'no-such-host.invalid' is not a name"):
        listen("no-such-host.invalid", port, 16)


def test_a_bad_tls_file_is_refused_before_anything_loads(tmp_path):
    from server.options import ServerOptions
    from server.serve import serve

    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"--ssl-certfile {junk} / --ssl-keyfile {junk}: not a PEM certificate"):
        serve(EngineArgs(), port=free_port(), options=ServerOptions(ssl_keyfile=str(junk), ssl_certfile=str(junk)))


# ---- what the device and the compiler report ----------------------------------------------------------


@pytest.fixture(scope="module")
def broken(stories_dir, tmp_path_factory) -> dict[str, Path]:
    return broken_copies(stories_dir, tmp_path_factory.mktemp("broken_in_process"))


def test_llm_raises_the_reason(broken):
    from jaxserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"model_type 'mamba' in \S+/config\.json is not supported"):
        LLM(str(broken["unknown_type"]))
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated"):
        LLM(str(broken["truncated"]))


@pytest.mark.parametrize("command, reason", [
    ("generate --model {unknown_type} --prompt hi", r"model_type 'mamba' in \S+/config\.json is not supported"),
    ("bench latency --model {truncated} --num-iters 1", r"\S+/model\.safetensors is truncated"),
    ("generate --model {wider_mlp} --prompt hi",
     r"weight '\S+' in \S+ has shape \(\d+, \d+\) but \S+/config\.json implies"),
])
def test_generate_and_bench_exit_with_the_reason(broken, capsys, command, reason):
    """`jaxserve generate` / `bench` go through the same `main` as `serve`: status 2, the reason last."""
    from jaxserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as exited:
        main(command.format(**broken).split())
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("jaxserve: error: ") and re.search(reason, last), last


OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2147483648 bytes."


@pytest.mark.parametrize("where, error, reason", [
    ("build", OUT_OF_MEMORY, r"out of device memory during loading the model: RESOURCE_EXHAUSTED: Out of memory "
                             r"while trying to allocate 2147483648 bytes\. Make the weights smaller \(--quantization"),
    ("warmup", OUT_OF_MEMORY, r"out of device memory during warm-up \(compiling the step programs\): .*a smaller KV "
                              r"cache \(now sized by --max-num-seqs \(2\) x --max-model-len\), or a smaller "
                              r"--max-num-batched-tokens \(now 16\)"),
    ("warmup", "INTERNAL: ptxas exited with non-zero error code 1",
     r"compiling a step program failed: INTERNAL: ptxas exited .*--attention-backend reference"),
])
def test_device_and_compiler_failures_name_the_options_to_change(monkeypatch, stories_dir, where, error, reason):
    from jax.errors import JaxRuntimeError

    from jaxserve.engine import engine as engine_module
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.execution.runner import ModelRunner

    def fail(*args, **kwargs):
        raise JaxRuntimeError(error)

    if where == "build":
        monkeypatch.setattr(engine_module, "build_model", fail)
    else:
        monkeypatch.setattr(ModelRunner, "warmup", fail)
    with pytest.raises(EngineStartError, match=reason) as raised:
        LLM(str(stories_dir), max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,))
    assert isinstance(raised.value.__cause__, JaxRuntimeError)  # the original, with its traceback
