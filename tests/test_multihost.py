"""Two processes on 127.0.0.1, 4 fake CPU devices each, form one 8-device mesh through jax.distributed
(gloo collectives) and generate what one device generates; with the tiny Gemma 3 (a device each, one mesh of
two), image conversations give the tokens one process gives, process 0 alone encoding the images.

Process 0 schedules and prints; process 1 follows its steps. Each run is bounded by a timeout and both
process groups are killed whatever happens, so a lone or stuck process cannot hang the suite.
"""

import json
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


def _start(args: list[str], log: Path, devices: int = 4, program: tuple = ("-m", "jaxserve")) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *program, *args], cwd=ROOT, env=_env(devices),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def _wait(procs, logs: list[Path]) -> list[str]:
    """Both processes' logs once both exited 0 (within TIMEOUT, else the test fails; neither is left)."""
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
    return out


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
    out = _wait(procs, logs)
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


# Run by both processes: the fixture's conversations in one batch (`LLM.chat`), the text-only one beside the
# images, through one step program of 32 tokens (every prompt is chunked; an image is never cut). Process 0
# prints each answer's tokens and their log-probabilities; both print what JAX lowered after warm-up.
VLM_SCRIPT = """
import json, logging, sys
import jax
from jaxserve import LLM
from jaxserve.sampling.params import SamplingParams
from sharding.multihost import shutdown
from tests.test_vlm_requests import CONVERSATIONS, VLM

logging.basicConfig(level=logging.INFO)
port, pid = sys.argv[1:]
llm = LLM(str(VLM / "gemma3"), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,),
          page_size=8, num_pages=96, tensor_parallel_size=2, distributed_coordinator=f"127.0.0.1:{port}",
          num_processes=2, process_id=int(pid))
lowered = []  # every program JAX lowers from here on, on whichever thread
jax.monitoring.register_event_duration_secs_listener(
    lambda event, *_, **__: event == "/jax/core/compile/jaxpr_to_mlir_module_duration" and lowered.append(event))
steps, relayed = [], []  # process 0: each step's image rows (None: none), each pytree it relayed
runner = llm.engine.runner
dispatch, send_batch = runner.dispatch, runner.channel.send_batch
runner.dispatch = lambda *args: steps.append(args[6]) or dispatch(*args)
runner.channel.send_batch = lambda batch: relayed.append(type(batch).__name__) or send_batch(batch)
cases = {"text_only": [{"role": "user", "content": "Say something short."}], **CONVERSATIONS}
outs = llm.chat(list(cases.values()), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
print("lowered after warm-up:", len(lowered), flush=True)
if outs:
    answers = {case: {"prompt": list(out.prompt_token_ids), "tokens": list(out.outputs[0].token_ids),
                      "logprobs": [entries[t].logprob for t, entries in zip(out.outputs[0].token_ids,
                                                                             out.outputs[0].logprobs)]}
               for case, out in zip(cases, outs)}
    print("ANSWERS", json.dumps(answers), flush=True)
    print("STEPS", json.dumps({"steps": len(steps), "with_images": sum(s is not None for s in steps),
                               "rows_relayed": relayed.count("EncoderRows")}), flush=True)
shutdown()
"""


def test_two_processes_serve_images_as_one(tmp_path):
    """Process 0 encodes each image and relays its rows with the step; process 1 loads no encoder. Greedy
    tokens equal transformers' (what one process gives: test_vlm_engine) and their log-probabilities are within
    1e-4 of its logits', for images and text alike, and neither process compiles after warm-up (the rows'
    relay included)."""
    import numpy as np

    from tests.test_vlm_engine import GOLDEN
    from tests.vlm_golden import log_softmax

    port = free_port()
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = [_start([str(port), str(i)], logs[i], devices=1, program=("-c", VLM_SCRIPT)) for i in range(2)]
    out = _wait(procs, logs)
    assert "process 1 of 2, 1 local / 2 global devices" in out[1]
    assert "relayed to the other processes" in out[0] and "vision encoder: on process 0" in out[1]
    assert all("lowered after warm-up: 0" in o for o in out), "\n".join(o[-3000:] for o in out)
    answers = json.loads(out[0].split("ANSWERS ", 1)[1].splitlines()[0])
    assert "ANSWERS" not in out[1]
    # Every step with image tokens, and only those, sent its rows along.
    steps = json.loads(out[0].split("STEPS ", 1)[1].splitlines()[0])
    assert 0 < steps["with_images"] == steps["rows_relayed"] < steps["steps"], steps
    assert set(answers) == {"text_only", "one_image", "two_images", "second_turn"}
    for case, answer in answers.items():
        ids = GOLDEN[f"{case}.input_ids"].tolist()
        assert answer["prompt"] == ids, case
        assert answer["tokens"] == GOLDEN[f"{case}.greedy"].tolist(), case
        logits = GOLDEN[f"{case}.logits"][len(ids) - 1:]
        reference = [log_softmax(row)[t] for row, t in zip(logits, answer["tokens"])]
        np.testing.assert_allclose(answer["logprobs"], reference, atol=1e-4, rtol=0, err_msg=case)
