"""What an XLA:GPU program launches, in order: its thunk sequence, read from XLA's dump.

1. A GPU compile with `xla_dump_to` set writes `*.thunk_sequence_after_thunk_passes.txt`: one line per
   thunk, nested by indentation. `kCommandBuffer` groups are CUDA graphs (one launch from the host runs
   them all); `kWhile` (condition, body) and `kConditional` (its branches) hold thunks of their own; every
   other thunk is one launch (a kernel, a memcpy, a library call), with its grid where it is a kernel.
2. `*.thunk_metadata.txt` names each thunk's HLO instruction by thunk id (the sequence prints a kernel's
   deduplicated name, shared by the layers' identical fusions).
3. `read_thunks(dump_dir)` returns the top-level thunks as a tree of `Thunk`s, each named by its HLO
   instruction.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

SEQUENCE = "thunk_sequence_after_thunk_passes.txt"
METADATA = "thunk_metadata.txt"
CONTAINERS = frozenset({"kCommandBuffer", "kSequential", "kWhile", "kConditional"})

_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s+\[[^\]]*\]\s*(.*?)\s*$")
_LABEL = re.compile(r"^(\s*)(\w+):\s*$")


@dataclasses.dataclass
class Thunk:
    id: int
    kind: str  # kCustomKernel, kCopy, kGemm, kCommandBuffer, kWhile, kConditional, ...
    name: str  # its HLO instruction (from the metadata), else the name the sequence prints
    launch: str  # what the sequence prints after the kind: kernel name, grid, threads, shared memory
    sections: dict[str, list[Thunk]] = dataclasses.field(default_factory=dict)  # "" | condition | body | branches

    @property
    def is_launch(self) -> bool:
        return self.kind not in CONTAINERS


def read_thunks(dump_dir: Path) -> list[Thunk]:
    """The program's top-level thunks, from the one module XLA dumped into `dump_dir`."""
    sequences = sorted(Path(dump_dir).glob(f"*{SEQUENCE}"))
    if len(sequences) != 1:
        raise FileNotFoundError(f"expected one *{SEQUENCE} in {dump_dir}, found {len(sequences)}: XLA:GPU writes "
                                f"it when the compile has the option xla_dump_to")
    metadata = sequences[0].with_name(sequences[0].name.replace(SEQUENCE, METADATA))
    names = parse_metadata(metadata.read_text()) if metadata.exists() else {}
    return parse_sequence(sequences[0].read_text(), names)


def parse_metadata(text: str) -> dict[int, str]:
    """thunk id -> HLO instruction name."""
    return {int(i): name for name, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', text)}


def parse_sequence(text: str, names: dict[int, str]) -> list[Thunk]:
    root = Thunk(-1, "kSequential", "", "", {"": []})
    stack: list[tuple[int, Thunk, str]] = [(-1, root, "")]  # (indent, thunk, the section its children go to)
    for line in text.splitlines():
        thunk, label = _THUNK.match(line), _LABEL.match(line)
        if thunk:
            indent = len(thunk.group(1))
            while stack[-1][0] >= indent:
                stack.pop()
            _, parent, section = stack[-1]
            number, kind, launch = int(thunk.group(2)), thunk.group(3), thunk.group(4)
            printed = launch.split(" grid:")[0].strip() or kind
            node = Thunk(number, kind, names.get(number, printed), launch)
            parent.sections.setdefault(section, []).append(node)
            stack.append((indent, node, ""))
        elif label:  # condition: / body: / false_branch: ... of the nearest loop or conditional above
            indent = len(label.group(1))
            while stack[-1][0] > indent:
                stack.pop()
            level, owner, _ = stack.pop()
            stack.append((level, owner, label.group(2)))
    return root.sections[""]
