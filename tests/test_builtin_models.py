"""The built-in models: stories260K shipped inside the package as the default, and the random demo by name.

1. With no model (`LLM()`, `jaxserve serve`), jaxserve serves the stories260K inside the package: byte for
   byte the documented checkpoint, named so it says what it is; greedy, it tells the known story, in a
   completion and in chat.
2. Its chat template (jaxserve's) makes the last user message the opening of a story.
3. Its files are package data: named in pyproject.toml, inside a wheel built from the sources, and small.
4. `demo-random` still builds the random demo model; a model that is neither a directory nor that name is
   a clear error.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.builtin_models import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME, RANDOM_DEMO_MODEL_NAME
from jaxserve.engine_args import EngineArgs
from jaxserve.entrypoints.args import engine_args_from
from jaxserve.entrypoints.cli import build_parser
from jaxserve.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json"]
SHIPPED = [*CHECKPOINT_FILES, "chat_template.jinja", "LICENSE", "README.md"]
GREEDY = dict(temperature=0)
# The known story's tokens after BOS: 61, or 57 after the prompt "Once upon a time" (4 tokens).
STORY_TOKENS, AFTER_PROMPT_TOKENS = 61, 57


@pytest.fixture(scope="module")
def default_llm():
    """`LLM()` with the shapes of conftest's `stories_llm`: the same programs, compiled once per run."""
    return LLM(max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(4, 64))


def test_the_default_is_the_shipped_stories260K_byte_for_byte(stories_dir):
    assert EngineArgs().model == str(DEFAULT_MODEL_DIR)
    assert engine_args_from(build_parser().parse_args(["serve"])).model == str(DEFAULT_MODEL_DIR)
    assert sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir()) == sorted(SHIPPED)
    for name in CHECKPOINT_FILES:
        assert (DEFAULT_MODEL_DIR / name).read_bytes() == (stories_dir / name).read_bytes(), name
    licence = (DEFAULT_MODEL_DIR / "LICENSE").read_text()
    assert "llama2.c" in licence and "MIT License" in licence


def test_the_default_model_tells_the_known_story(default_llm, story_text):
    assert default_llm.engine.model_name == DEFAULT_MODEL_NAME
    out = default_llm.generate(["Once upon a time"], SamplingParams(**GREEDY, max_tokens=AFTER_PROMPT_TOKENS))
    assert "Once upon a time" + out[0].outputs[0].text == story_text
    continued = out[0].outputs[0].token_ids
    # Chat: a request for a story leaves the whole story to the model; an opening is continued as written.
    told, opened = (default_llm.chat([{"role": "user", "content": text}], SamplingParams(**GREEDY, max_tokens=n))
                    for text, n in (("Tell me a story", STORY_TOKENS), ("Once upon a time", AFTER_PROMPT_TOKENS)))
    assert told[0].outputs[0].text == story_text
    assert opened[0].outputs[0].token_ids == continued


@pytest.mark.parametrize("messages, prompt", [
    ([{"role": "user", "content": "Once upon a time"}], "Once upon a time"),
    ([{"role": "user", "content": "once upon a time, a frog "}], "once upon a time, a frog"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story about a dog!"}],
     "Once upon a time, there was a dog."),
    ([{"role": "user", "content": [{"type": "text", "text": "Write a story about"}, {"type": "text", "text": "Max"}]}],
     "Once upon a time, there was Max."),
    ([{"role": "user", "content": "Tell me a story"}], ""),
    ([{"role": "user", "content": "Lily found a puppy."}], "Once upon a time, Lily found a puppy."),
    ([{"role": "user", "content": "Hello"}], "Once upon a time, Hello."),
    ([{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": ", a cat"},
      {"role": "user", "content": "a dragon"}], "Once upon a time, a dragon."),
    ([{"role": "system", "content": "nothing from the user"}], ""),
])
def test_the_chat_template_makes_the_last_user_message_a_story_opening(messages, prompt):
    tokenizer = Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert tokenizer.apply_chat_template(messages) == "<s>" + prompt


def test_the_files_are_package_data_and_small():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = DEFAULT_MODEL_DIR.parent
    for path in DEFAULT_MODEL_DIR.iterdir():
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs["jaxserve.builtin_models"]), relative
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) < 1_100_000  # 1.07 MB today


def test_a_wheel_built_from_the_sources_carries_the_model(tmp_path):
    """Built from a copy of the sources, so the checkout gets no build/ or egg-info from it."""
    source = tmp_path / "src"
    for name in ("jaxserve", "server", "sharding", "pallas_kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # Without setuptools here pip builds in an isolated environment, fetching it from the package index.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", *isolation, "-w",
                            str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("jaxserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"jaxserve/builtin_models/stories260K/{name}" for name in SHIPPED} <= names


def test_the_random_demo_model_is_there_by_name(tmp_path):
    from jaxserve.engine.engine import Engine
    args = EngineArgs("demo-random", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32)
    assert args.random_demo and args.model_dir is None
    engine = Engine(args)  # no warm-up: nothing is compiled
    assert engine.model_name == RANDOM_DEMO_MODEL_NAME and engine.tokenizer.vocab_size == 259  # one per byte
    with pytest.raises(ValueError, match="not a directory .* nor the random demo model's name 'demo-random'"):
        EngineArgs(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="random demo model has its own byte-level tokenizer"):
        EngineArgs("demo-random", tokenizer=str(DEFAULT_MODEL_DIR))
