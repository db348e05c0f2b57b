import os
from pathlib import Path

# Tests run on the CPU; asking for it up front keeps JAX from probing for accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

# tests/multidevice needs 8 fake CPU devices, fixed when JAX starts: tests/test_sharding.py runs it as a
# separate pytest process with JAX_NUM_CPU_DEVICES=8 and JAXSERVE_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("JAXSERVE_MULTIDEVICE") == "1" else ["multidevice"]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real stories260K checkpoint, read in place from ../shared/models (never copied)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"


@pytest.fixture(scope="session")
def mapped_stories_dir(stories_dir, tmp_path_factory) -> Path:
    """stories260K converted by `jaxserve convert --format mapped` (the model's own layout, aligned)."""
    from jaxserve.entrypoints.cli import main as cli_main
    out = tmp_path_factory.mktemp("ckpt") / "stories260K-mapped"
    assert cli_main(["convert", "--model", str(stories_dir), "--output", str(out), "--format", "mapped"]) == 0
    return out


STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
         "One day, she saw a big, red ball. She wanted to play with it, but it was too high.")


@pytest.fixture(scope="session")
def story_text() -> str:
    """The documented greedy continuation of stories260K from the bare BOS prompt (shared/models/README.md)."""
    return STORY


@pytest.fixture(scope="session")
def stories_llm(stories_dir):
    """One warmed-up offline engine over stories260K, shared by the tests that only read from it."""
    from jaxserve import LLM
    return LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=64)
