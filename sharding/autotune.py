"""XLA's GPU autotuning results as files: what a device writes, joined, checked and loaded by a compile here.

1. On a GPU, XLA picks each GEMM fusion's backend and tiles (Triton or cuBLAS) by timing candidates while it
   compiles; a compile without the device (`compile_only.py`) takes untuned defaults. With
   `XLA_FLAGS=--xla_gpu_dump_autotune_results_to=FILE.txt` a device process writes what it tuned, as a text
   proto (`AutotuneResults`: a `version`, then a `results { device hlo result }` per tuned fusion), the whole
   process's results rewritten after every compile, so the file ends holding all of them.
2. `AutotuneResults.parse` reads such a file (only the top level of the text proto: the entries stay text),
   and `merge` joins several processes' files, one entry per (device, fusion): what the session script
   brings back from a lease (`benchmarks/gpu_session.sh`) and the repository keeps (benchmarks/autotune/).
   Newer XLA releases try another layout first (`xla.autotuner.AutotuneCache`, then fall back to this
   one); a file in it is merged entry by entry too, exact repeats dropped.
3. An entry's `device` is XLA's key of the GPU it was tuned on (compute capability, cores, clock, memory
   bandwidth, L2, ...). XLA uses an entry only for a GPU of the same key, so `load_option` checks the file
   before a compile uses it: it must exist and hold entries, and `AutotuneResults.devices` says which keys
   it holds, for the caller to set beside its target's.
4. XLA reads the file named by the compile option `xla_gpu_load_autotune_results_from` once per process:
   later compiles of the process use what the first loaded, whatever file they name. An entry whose key
   does not match is not used, silently; with `xla_gpu_require_complete_aot_autotune_results` a compile
   without the device fails on the first fusion that finds no entry ("No cached config found for HLO
   instr"), which is how to tell that a file fits a compile. (XLA 0.12's compiler, checked here: it reads
   a file as its newer `xla.autotuner.AutotuneCache` first, then as this legacy format, version 3, and a
   compile without the device writes no results of its own.)
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

LOAD_OPTION = "xla_gpu_load_autotune_results_from"
REQUIRE_COMPLETE_OPTION = "xla_gpu_require_complete_aot_autotune_results"  # a fusion without an entry fails
DUMP_FLAG = "--xla_gpu_dump_autotune_results_to"
_FIELD = re.compile(r'^\s*(device|hlo): "((?:[^"\\\n]|\\.)*)"', re.MULTILINE)
_START = re.compile(r"(\w+)\s*(:\s*([^\s{]+)|\{)")  # `field: scalar` or `field {`


class AutotuneFileError(ValueError):
    """A results file that is missing, empty, not XLA's text format, or holds no entries."""


@dataclasses.dataclass
class AutotuneResults:
    scalars: dict[str, str]  # top-level `field: value`s (the legacy format's `version`)
    entries: dict[tuple[str, ...], str]  # an entry's key -> its whole `field { ... }` text

    @classmethod
    def parse(cls, text: str, name: str = "the text") -> "AutotuneResults":
        """A file's fields. Written by XLA's legacy AutotuneResults (`version`, then `results { device hlo
        result }`), an entry is keyed by its device and fusion; in another layout (newer XLA releases read an
        `xla.autotuner.AutotuneCache` first) by its whole text, so merging still drops only exact repeats."""
        scalars, entries = {}, {}
        for field, value, message in _top_level(text, name):
            if not message:
                scalars.setdefault(field, value)
                continue
            keys = dict(_FIELD.findall(value))
            key = (keys["device"], keys["hlo"]) if {"device", "hlo"} <= keys.keys() else (value,)
            entries.setdefault(key, value)
        return cls(scalars, entries)

    def devices(self) -> dict[str, int]:
        """Entries per device key (XLA's key of the GPU an entry was tuned on)."""
        return dict(collections.Counter(key[0] if len(key) == 2 else "(no device field)" for key in self.entries))

    def text(self) -> str:
        return "".join(f"{field}: {value}\n" for field, value in self.scalars.items()) + "".join(
            entry + "\n" for entry in self.entries.values())


def _top_level(text: str, name: str):
    """(field, value, whether a message) at the text proto's top level: scalars as their text, messages as
    their whole `field { ... }` text. Braces inside quoted strings (a fusion's HLO) do not count."""
    i, n = 0, len(text)
    while i < n:
        if text[i].isspace():
            i += 1
            continue
        if text[i] == "#":  # a comment, to the end of its line
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        match = _START.match(text, i)
        if match is None:
            raise AutotuneFileError(f"{name}: not a text proto at character {i}: {text[i:i + 60]!r}")
        if match.group(3) is not None:  # `field: scalar`
            yield match.group(1), match.group(3), False
            i = match.end()
            continue
        depth, j, quoted = 1, match.end(), False
        while depth and j < n:
            c = text[j]
            if quoted:
                if c == "\\":
                    j += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            j += 1
        if depth:
            raise AutotuneFileError(f"{name}: `{match.group(1)} {{` at character {i} is never closed (cut short?)")
        yield match.group(1), text[i:j], True
        i = j


def read_results(path: str | Path) -> AutotuneResults:
    """The file's results; a clear error when it is missing, empty or not XLA's text format."""
    path = Path(path)
    if not path.is_file():
        raise AutotuneFileError(f"autotune results file {path} does not exist")
    if path.suffix not in (".txt", ".textproto"):
        raise AutotuneFileError(f"{path}: XLA reads a results file as text only when its name ends in .txt or "
                                f".textproto (else as a binary proto); these are kept as text")
    text = path.read_text()
    if not text.strip():
        raise AutotuneFileError(f"autotune results file {path} is empty")
    results = AutotuneResults.parse(text, str(path))
    if "version" in results.scalars and not results.entries:
        raise AutotuneFileError(f"autotune results file {path} holds no entries: nothing was tuned")
    return results


def merge(results: list[AutotuneResults]) -> AutotuneResults:
    """One set of results from several processes' (the first entry of a key kept). Their top-level scalars
    (the format's version) must agree: files of different XLA releases do not mix."""
    merged = AutotuneResults({}, {})
    for r in results:
        for field, value in r.scalars.items():
            if merged.scalars.setdefault(field, value) != value:
                raise AutotuneFileError(f"results of different {field}s ({merged.scalars[field]} and {value}): "
                                        f"from different XLA releases")
        for key, entry in r.entries.items():
            merged.entries.setdefault(key, entry)
    return merged


def load_option(path: str | Path) -> tuple[dict, AutotuneResults]:
    """The compile option that loads `path` (checked first: see `read_results`), and what it holds."""
    results = read_results(path)
    if not results.entries:
        raise AutotuneFileError(f"autotune results file {path} holds no entries: not XLA's results, or nothing "
                                f"was tuned")
    return {LOAD_OPTION: str(Path(path).resolve())}, results
