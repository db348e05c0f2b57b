"""The models jaxserve serves without being given one, so a first `serve` on a fresh machine needs no files.

1. With no model (`jaxserve serve`, `LLM()`, `EngineArgs()`), `resolve_model` answers the directory of
   stories260K shipped inside this package: llama2.c's 260K-parameter Llama trained on TinyStories (MIT
   licence; stories260K/README.md and LICENSE say where it comes from). It is an ordinary Hugging Face
   folder read by the ordinary loader, plus a chat template of jaxserve's that turns a chat into the
   opening of a story, so chat, completions and the playground all answer with words. It is served as
   `DEFAULT_MODEL_NAME`.
2. `--model demo-random` (`RANDOM_DEMO_MODEL`) asks for the random demo instead: a small Llama built in
   memory with deterministic random weights and a byte-level tokenizer (`jaxserve/engine/builder.py`),
   for tests and experiments that want a model with no trained behaviour. Its text is noise.

No JAX here: the CLI resolves its defaults before the engine loads.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "stories260K"
DEFAULT_MODEL_NAME = "jaxserve-builtin-stories260K"
RANDOM_DEMO_MODEL = "demo-random"  # the name that asks for the random demo (a folder of that name: ./demo-random)
RANDOM_DEMO_MODEL_NAME = "jaxserve-demo-random"


def resolve_model(model: str | None) -> str:
    """The model a user means: the built-in default for None, else what was given."""
    return str(DEFAULT_MODEL_DIR) if model is None else model


def is_random_demo(model: str | None) -> bool:
    return model == RANDOM_DEMO_MODEL


def is_default(model: str) -> bool:
    return not is_random_demo(model) and Path(model).resolve() == DEFAULT_MODEL_DIR


def directory_of(model: str | None) -> str | None:
    """The directory of a resolved model, None for the random demo (it has no files)."""
    return None if model is None or is_random_demo(model) else model


def served_name(model: str) -> str:
    """The name a resolved model is served under when --served-model-name gives none: the built-in ones say
    what they are, any other is named after its directory."""
    if is_random_demo(model):
        return RANDOM_DEMO_MODEL_NAME
    return DEFAULT_MODEL_NAME if is_default(model) else Path(model).resolve().name


def describe(model: str) -> str:
    """What a resolved model is, in a few words (logs, /v1/models)."""
    if is_random_demo(model):
        return f"random demo model {RANDOM_DEMO_MODEL!r} (random weights, byte-level tokenizer: its text is noise)"
    if is_default(model):
        return ("built-in default model, stories260K (llama2.c's, trained on TinyStories: it tells children's "
                "stories; --model DIR serves another)")
    return model
