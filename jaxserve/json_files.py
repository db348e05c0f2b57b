"""A model folder's JSON files (config.json, generation_config.json, tokenizer_config.json, a sharded
checkpoint's index, ...), read so that a broken one is reported as a fact about that file.

1. `read_json_object(file)` returns the file's JSON object, or {} when the file is absent (most of these
   files are optional; `required=True` makes an absent one an error naming it).
2. A file that is not valid JSON is a ValueError naming it with the line and column of the fault, and one
   whose top level is not an object is a ValueError naming what it holds instead: the message a user
   needs to fix or re-download that file, where json's own ("Expecting property name ...") names none.
3. `json_object_option(value, name, example)`: an option given as JSON text (the CLI) or a dict (`LLM`), as
   the dict, or a ValueError naming the option with an example of its form.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(file: str | Path, required: bool = False) -> dict:
    file = Path(file)
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file} not found")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg} "
                         f"(fix or re-download it)") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: byte {e.start} is not UTF-8 (fix or re-download it)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} should hold a JSON object, found {type(data).__name__} (fix or re-download it)")
    return data


def json_object_option(value: str | dict, name: str, example: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON (e.g. '{example}'): {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object such as {example}, got {value!r}")
    return value
