"""The tests that need 8 devices (tests/multidevice: tensor and pipeline parity, Orbax re-sharding).

JAX fixes its device count when it starts, so each part of that suite runs as a pytest process of its own
with JAX_NUM_CPU_DEVICES=8; the main process (one device) does not collect tests/multidevice (see
tests/conftest.py). The parts are separate tests so that pytest-xdist runs them beside the rest of the suite
and beside each other; the `-k` expressions of one file are complements, so every test runs exactly once.
A part's output is shown when it fails.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PARTS = {
    "mesh-greedy": ["tests/multidevice/test_mesh.py", "-k", "not sharded_logits and not expert_parallel"],
    "mesh-parity": ["tests/multidevice/test_mesh.py", "-k", "sharded_logits and not (gemma or moe or mixtral)"],
    # Issue 29's families under tensor, pipeline and expert parallelism.
    "mesh-families": ["tests/multidevice/test_mesh.py", "-k",
                      "(sharded_logits and (gemma or moe or mixtral)) or expert_parallel"],
    # One process for the short files: each part pays a JAX start and a collection.
    "checkpoint-embeddings-lora": ["tests/multidevice/test_checkpoint.py", "tests/multidevice/test_embeddings_mesh.py",
                                   "tests/multidevice/test_lora_tp.py"],
}


# The subprocess limit is the one that counts; the test's own is a little longer so its failure shows the output.
@pytest.mark.timeout(960)
@pytest.mark.parametrize("part", PARTS)
def test_multidevice_part_on_8_fake_cpu_devices(part):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", JAXSERVE_MULTIDEVICE="1",
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip())
    # -n 0: the part runs in this one process (the suite's xdist workers are the parallelism).
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *PARTS[part]],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and "passed" in summary and "skipped" not in summary, \
        result.stdout[-8000:] + result.stderr[-4000:]
