"""The `serve` flags vLLM users pass from habit, and vLLM's metric names.

One server, built from a `jaxserve serve` command line the way the CLI builds it (parser -> EngineArgs
and ServerOptions -> uvicorn config), serves over TLS (a self-signed certificate made here) behind a
`--root-path`, with a separate `--tokenizer` directory, `--block-size`, `--seed`, an API key, its own
uvicorn log level and no access log.
"""

from __future__ import annotations

import json
import os
import random
import ssl
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.entrypoints.async_engine import AsyncEngine
from jaxserve.entrypoints.args import engine_args_from
from jaxserve.entrypoints.cli import build_parser, main
from server.cli import server_options_from
from server.app import build_app
from server.serving.metrics import VLLM_NAMES
from server.http.connection import uvicorn_config
from tests.server_harness import free_port

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def self_signed_certificate(directory) -> tuple[str, str]:
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


def tokenizer_dir(stories_dir, directory):
    """stories260K's tokenizer with a chat template of its own, in a directory without the model."""
    directory.mkdir()
    os.symlink(stories_dir / "tokenizer.json", directory / "tokenizer.json")
    config = json.loads((stories_dir / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return directory


@pytest.fixture(scope="module")
def command_line(stories_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    key, cert = self_signed_certificate(tmp)
    argv = ["serve", str(stories_dir), "--tokenizer", str(tokenizer_dir(stories_dir, tmp / "tok")),
            "--block-size", "8", "--root-path", "/llm", "--ssl-keyfile", key, "--ssl-certfile", cert,
            "--uvicorn-log-level", "warning", "--disable-log-requests", "--seed", "1234", "--api-key", KEY,
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--token-buckets", "16,64"]
    return argv, cert


@pytest.fixture(scope="module")
def server(command_line):
    argv, cert = command_line
    ns = build_parser().parse_args(argv)
    args = engine_args_from(ns)
    options = server_options_from(ns, args)
    engine = AsyncEngine(args)
    engine.start()
    app = build_app(engine, options)
    port = free_port()
    uvicorn_server = uvicorn.Server(uvicorn_config(app, options, host="127.0.0.1", port=port))
    thread = threading.Thread(target=uvicorn_server.run, daemon=True)
    thread.start()
    base = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=cert)  # the self-signed certificate, and nothing else
    client = httpx.Client(base_url=base, verify=trust, headers=AUTH, timeout=120)
    try:
        wait_healthy_tls(client, 300)
        yield client, app.state.context, uvicorn_server.config, args, base, trust
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)
        engine.shutdown()


def wait_healthy_tls(client: httpx.Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the TLS server did not become healthy")


def test_flags_reach_the_engine_and_uvicorn(server):
    _, _, config, args, *_ = server
    assert args.page_size == 8 and args.tokenizer.endswith("tok")
    assert (config.root_path, config.log_level, config.access_log) == ("/llm", "warning", False)
    assert config.ssl_keyfile and config.ssl_certfile


def test_https_behind_a_root_path(server):
    client, _, _, _, base, trust = server
    # The proxy strips /llm before forwarding: routes answer at their own paths, /health without the key.
    assert httpx.get(f"{base}/health", verify=trust).status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "stories260K"
    assert httpx.get(f"{base}/v1/models", verify=trust).status_code == 401
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with pytest.raises(httpx.TransportError):  # TLS only
        httpx.get(base.replace("https", "http") + "/health")


def test_tokenizer_directory_brings_its_chat_template(server):
    client, *_ = server
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    rendered = "[user] Hi\n[assistant]"
    count = client.post("/tokenize", json={"prompt": rendered, "add_special_tokens": False}).json()["count"]
    assert reply.json()["usage"]["prompt_tokens"] == count


def test_seed_repeats_unseeded_sampling(server):
    client, context, *_ = server

    def two_samples() -> list[str]:
        return [client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 12,
                                                     "temperature": 1.0}).json()["choices"][0]["text"]
                for _ in range(2)]

    context.seeds = random.Random(1234)  # as a restart with --seed 1234 finds it
    first = two_samples()
    context.seeds = random.Random(1234)
    assert two_samples() == first
    assert first[0] != first[1]  # each request draws its own seed from the sequence


def test_vllm_metric_names_carry_our_values(server):
    client, *_ = server
    for stream in (False, True):
        client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "stream": stream})
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    # Speculation counters exist only on a server that speculates, as in vLLM
    # (test_speculative_metrics checks them there); this server does not.
    speculation = {ours for ours in VLLM_NAMES if ours.startswith("jaxserve:spec_decode_")}
    assert speculation and not speculation & families.keys()
    for ours, theirs in VLLM_NAMES.items():
        if ours in speculation:
            assert not set(theirs) & families.keys(), theirs
            continue
        for name in theirs:
            assert name in families, name
            ours_samples = {(s.name.replace(ours, ""), tuple(sorted(s.labels.items()))): s.value
                            for s in families[ours].samples}
            their_samples = {}
            for s in families[name].samples:
                labels = dict(s.labels)
                assert (labels.pop("model_name"), labels.pop("engine")) == ("stories260K", "0")
                their_samples[(s.name.replace(name, ""), tuple(sorted(labels.items())))] = s.value
            assert their_samples == ours_samples, name  # same values, same buckets
    assert families["vllm:request_success"].samples[0].labels["finished_reason"] == "length"
    assert sum(s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")) >= 10
    assert {s.name for s in families["vllm:time_to_first_token_seconds"].samples} >= {
        "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_count"}
    queued = next(s for s in families["vllm:request_queue_time_seconds"].samples if s.name.endswith("_count"))
    assert queued.value >= 2


def test_revision_is_refused_by_name(stories_dir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", str(stories_dir), "--revision", "main"])
    assert exit_.value.code == 2
    assert "--revision main: jaxserve loads local directories" in capsys.readouterr().err


def test_tokenizer_must_be_a_directory(stories_dir):
    with pytest.raises(ValueError, match="tokenizer"):
        engine_args_from(build_parser().parse_args(["serve", str(stories_dir), "--tokenizer", "/nonexistent"]))
