"""Chat templates: messages rendered to one prompt string in a bounded jinja2 sandbox.

Templates ship with downloaded models, so they are untrusted code:
1. `compile_template` compiles a template in an immutable sandbox (a template cannot reach Python
   internals or mutate the messages it is given) that also refuses huge `*` and `**` results; compiled
   templates are cached by source.
2. `render` runs it with a time limit (a trace hook on this thread) and a cap on the output. Any failure
   of the template is a `ChatTemplateError` (a ValueError: the client's problem, a 400).
3. `find_chat_template` reads a model folder's template (chat_template.jinja, else tokenizer_config.json).
"""

from __future__ import annotations

import json
import operator
import sys
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

TEMPLATE_TIME_LIMIT = 2.0  # seconds a chat template may render for
MAX_TEMPLATE_OUTPUT = 8 << 20  # characters a rendered prompt may have
_MAX_REPEAT = 1 << 20  # elements or characters one `*` / `**` in a template may produce


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (the client's problem: a 400)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; prompts (tool schemas) need them as is.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox (a template cannot reach Python internals or mutate the messages it is
    given), plus limits on `*` and `**`: `'x' * 10**10` must fail, not allocate."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator_name: str, left, right):
        if operator_name == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise SecurityError("exponent too large in a chat template")
            return operator.pow(left, right)
        for seq, count in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(count, int) and len(seq) * count > _MAX_REPEAT:
                raise SecurityError("a repetition in the chat template is too large")
        return operator.mul(left, right)


def render(template: jinja2.Template, variables: dict, time_limit: float | None) -> str:
    """Render with a deadline (checked on every line the compiled template runs, through a trace hook on
    this thread only) and a cap on the output."""
    deadline = None if time_limit is None else time.monotonic() + time_limit

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"the chat template ran for more than {time_limit:g} s")
        return trace

    previous = sys.gettrace()
    if deadline is not None:
        sys.settrace(trace)
    try:
        pieces, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_TEMPLATE_OUTPUT:
                raise ChatTemplateError(f"the rendered prompt exceeds {MAX_TEMPLATE_OUTPUT} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        if deadline is not None:
            sys.settrace(previous)


# The same settings as transformers, so templates written for it render identically.
_TEMPLATE_ENV = _BoundedSandbox(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_TEMPLATE_ENV.globals["raise_exception"] = _raise_exception
_TEMPLATE_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
_TEMPLATE_ENV.filters["tojson"] = _tojson


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    # Compiling costs milliseconds; every chat request would otherwise pay it.
    return _TEMPLATE_ENV.from_string(source)


def find_chat_template(path: Path, tok_cfg: dict) -> str | None:
    # transformers now saves the template as its own file; it wins over the JSON copy.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
