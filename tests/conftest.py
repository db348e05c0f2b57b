import os
import shutil
import tempfile
from pathlib import Path

# Tests run on the CPU; asking for it up front keeps JAX from probing for accelerators.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU and GPU compilers of the compile-only tests: where `./dev` installs them, when pytest runs alone.
_COMPILERS = Path(__file__).resolve().parents[1] / ".venv" / "compilers"
if _COMPILERS.is_dir():
    os.environ.setdefault("JAXSERVE_COMPILERS", str(_COMPILERS))

import pytest

_CACHE_ENV = "JAXSERVE_TEST_COMPILATION_CACHE"

pytest_plugins = ["tests.compile_report"]  # the compilation share of the run, in its summary


def pytest_configure(config):
    """One compilation cache for the whole run, before anything imports JAX: JAX's persistent cache and,
    beside it, the engine's program cache (jaxserve's `ProgramCache.beside_jax_cache`). Most tests build
    engines of the same few shapes; with the cache each step program is traced and compiled once per run,
    and every later engine of that shape loads it. The run's first process (the xdist controller, or a
    plain pytest) makes the folder and removes it at the end; xdist workers and the tests' subprocesses
    (servers, the 8-device suite) inherit it through the environment. It lives for one run only: tests
    that check what a start compiles give their programs shapes no other test uses."""
    if not os.environ.get(_CACHE_ENV):
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxserve-test-cache-")
        config._jaxserve_owned_cache = os.environ[_CACHE_ENV]
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_ENV]
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"  # the tests' programs are small and many
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # A size limit turns on JAX's file lock: two workers may write and read the same entry at once.
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
    # Two thirds of the suite's time is compiling, mostly for the CPU, programs that then run a few tiny
    # steps. LLVM's optimization is a third of a stories260K engine's backend compile (12 s, 8.3 s without
    # it) and buys nothing at these sizes. Numbers move in their last bits at most (stories260K's greedy
    # tokens stay, a logprob of -9.483461 reads -9.483457), as between two CPUs, which the tests' tolerances
    # allow for anyway. The HLO passes, whose fusions and memory the TPU and GPU compile-only tests read,
    # run as before. Servers and the 8-device suite inherit it.
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each holds a JAX runtime and its compiled programs)."""
    return min(os.cpu_count() or 1, 4)


def pytest_unconfigure(config):
    owned = getattr(config, "_jaxserve_owned_cache", None)
    if owned:
        shutil.rmtree(owned, ignore_errors=True)


@pytest.fixture
def no_program_cache(monkeypatch):
    """For tests that hook the runner's tracing (`StepCompiler.lower`): a program loaded from the program
    cache is never traced, so their hook would not run. JAX's own cache, which comes after tracing, stays."""
    from jaxserve.execution.program_cache import ProgramCache
    monkeypatch.setattr(ProgramCache, "beside_jax_cache", classmethod(lambda cls: cls(None)))

# tests/multidevice needs 8 fake CPU devices, fixed when JAX starts: tests/test_sharding.py runs it as a
# separate pytest process with JAX_NUM_CPU_DEVICES=8 and JAXSERVE_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("JAXSERVE_MULTIDEVICE") == "1" else ["multidevice"]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """The real stories260K checkpoint, read in place from ../shared/models (never copied)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"


@pytest.fixture(scope="session")
def id_tokenizer(tmp_path_factory) -> Path:
    """A 256-token word-level tokenizer ("t0".."t255") for the random fixtures, which have none; pass it as
    `LLM(..., tokenizer=...)` and prompts as token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    directory = tmp_path_factory.mktemp("ids")
    Tokenizer(WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


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
    return LLM(str(stories_dir), max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(4, 64))
