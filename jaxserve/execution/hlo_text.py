"""A compiled program's HLO, read from its text (`compiled.as_text()`): computations, instructions, shapes.

1. `HloModule.parse(text)` splits the module into computations (`%name (...) -> ... {` to `}`) and each
   into instructions in order (a scheduled module's order is its execution order): name, result shape,
   opcode, operand names, and the attribute text after them, which the few attributes a profile needs
   are read from (`Instruction.attr`, `.called`).
2. `shape_bytes(shape)` counts an array or tuple shape's bytes in device memory (HBM): arrays placed in
   another memory space (`S(n)` in a TPU layout: VMEM, SMEM, sync flags) count nothing.
3. `HloModule.origin(computation, name)` follows a value back through what keeps its data (bitcasts, tuple
   elements, asynchronous copies and slices into another memory space, a loop's or branch's parameters to
   the operands given at the call) to the instruction that made it: an entry parameter, for a weight.
"""

from __future__ import annotations

import dataclasses
import re

# Bytes per element of XLA's primitive types; sub-byte types pack (s4: two to a byte).
_ELEMENT_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                  "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
                  "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = ")
# What a value is still the same data through: a bitcast; an asynchronous copy or slice (XLA:TPU's DMAs into
# VMEM) and its wait.
SAME_DATA = frozenset({"bitcast", "copy-start", "copy-done", "slice-start", "slice-done", "dynamic-slice-start",
                       "dynamic-slice-done"})


def element_bytes(dtype: str) -> float:
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return {"f4": 0.5, "f6": 0.75}.get(dtype[:2], 1)
    return _ELEMENT_BYTES.get(dtype, 0)


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    memory_space: int  # 0: device memory (HBM); TPU layouts name others with S(n)

    @property
    def elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        return int(self.elements * element_bytes(self.dtype))


def arrays(shape: str) -> list[Array]:
    """The arrays of a shape's text, a tuple's in order."""
    found = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        found.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(space.group(1)) if space else 0))
    return found


def shape_bytes(shape: str) -> int:
    """Bytes of `shape`'s arrays in device memory (HBM); arrays in another memory space count 0."""
    return sum(a.bytes for a in arrays(shape) if a.memory_space == 0)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # result shape text, layouts included
    opcode: str
    operands: list[str]  # operand names, `%` dropped; `x#1` names element 1 of x's tuple
    rest: str  # attribute text after the operands
    index: int  # position in its computation

    def attr(self, key: str, default: str | None = None) -> str | None:
        """An attribute's value text: `calls`, `kind`, `custom_call_target` (quotes dropped), ..."""
        found = re.search(rf"\b{re.escape(key)}=(\"[^\"]*\"|\{{[^}}]*\}}|[^,\s]+)", self.rest)
        return found.group(1).strip('"') if found else default

    @property
    def called(self) -> list[str]:
        """Computations this instruction runs: a fusion's, a loop's condition and body, a conditional's
        branches in the order of the operands they take (true then false, for a predicate), a call's."""
        names = []
        for key in ("calls", "condition", "body", "true_computation", "false_computation", "to_apply"):
            value = self.attr(key)
            if value:
                names.append(value.lstrip("%"))
        branches = self.attr("branch_computations")
        if branches:
            names += [b.strip().lstrip("%") for b in branches.strip("{}").split(",")]
        return names

    @property
    def op_name(self) -> str:
        found = re.search(r'op_name="([^"]*)"', self.rest)
        return found.group(1) if found else ""

    @property
    def trip_count(self) -> int | None:
        """A loop's trip count, where XLA knows it (its backend config)."""
        found = re.search(r'"known_trip_count":\{"n":"(\d+)"', self.rest)
        return int(found.group(1)) if found else None


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction]
    by_name: dict[str, Instruction]
    root_index: int = -1

    @property
    def root(self) -> Instruction:
        return self.instructions[self.root_index]

    def parameter(self, number: int) -> Instruction | None:
        return next((i for i in self.instructions if i.opcode == "parameter" and i.operands == [str(number)]), None)

    def users(self, name: str) -> list[tuple[Instruction, int]]:
        """(user, operand position) of every use of `name` in this computation."""
        return [(i, k) for i in self.instructions for k, o in enumerate(i.operands) if o.split("#")[0] == name]


@dataclasses.dataclass
class HloModule:
    computations: dict[str, Computation]
    entry: Computation
    callers: dict[str, tuple[Computation, Instruction]]  # a loop's or branch's computation -> its call site
    index: dict[str, tuple[Computation, Instruction]] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, text: str) -> "HloModule":
        computations, current, root = {}, None, -1
        for line in text.splitlines():
            if current is None:
                header = _HEADER.match(line)
                if header and not line.startswith("HloModule"):
                    current, root = Computation(header.group(2), bool(header.group(1)), [], {}), -1
                continue
            if line.startswith("}"):  # "}" or, for another execution thread, "}, execution_thread=..."
                current.root_index = root
                computations[current.name] = current
                current = None
                continue
            instruction = _parse_instruction(line, len(current.instructions))
            if instruction is not None:
                if line.lstrip().startswith("ROOT "):
                    root = instruction.index
                current.instructions.append(instruction)
                current.by_name[instruction.name] = instruction
        entry = next((c for c in computations.values() if c.entry), None)
        if entry is None:
            raise ValueError("no ENTRY computation in this HLO text")
        callers, index = {}, {}
        for computation in computations.values():
            for instruction in computation.instructions:
                index[instruction.name] = (computation, instruction)
                if instruction.opcode in ("while", "conditional", "call"):
                    for called in instruction.called:
                        callers[called] = (computation, instruction)
        return cls(computations, entry, callers, index)

    def find(self, name: str) -> tuple[Computation, Instruction] | None:
        """The computation holding instruction `name`, and the instruction (names are unique in a module)."""
        return self.index.get(name)

    def trip_count(self, loop: Instruction) -> int | None:
        """A `while`'s trip count: XLA's own figure where its backend config has one, else read from a
        condition `counter < constant` (the counter counting from 0, as lax's loops do)."""
        if loop.trip_count is not None:
            return loop.trip_count
        condition = self.computations.get(loop.attr("condition", "").lstrip("%"))
        root = condition.root if condition else None
        if root is None or root.opcode != "compare" or root.attr("direction") != "LT":
            return None
        bound = condition.by_name.get(root.operands[1])
        if bound is not None and bound.opcode == "constant" and bound.operands and bound.operands[0].isdigit():
            return int(bound.operands[0])
        return None

    def origin(self, computation: Computation, name: str) -> tuple[Computation, Instruction] | None:
        """The instruction that made value `name` of `computation`, looking through what keeps its data."""
        elements: list[int] = []  # the tuple elements being followed, innermost last
        for _ in range(10_000):  # a chain, not a cycle: the bound only guards against malformed text
            base, _, index = name.partition("#")
            if index:
                elements.append(int(index))
            instruction = computation.by_name.get(base)
            if instruction is None:
                return None
            op = instruction.opcode
            if op == "get-tuple-element":
                elements.append(int(instruction.attr("index")))
                name = instruction.operands[0]
            elif op == "tuple" and elements:
                name = instruction.operands[elements.pop()]
            elif op in SAME_DATA:
                name = instruction.operands[0]
            elif op == "parameter" and not computation.entry and computation.name in self.callers:
                called = computation.name
                computation, call = self.callers[called]
                if call.opcode == "while":  # its one parameter: the carried tuple
                    name = call.operands[0]
                elif call.opcode == "conditional":  # operand 0 picks the branch; branch n takes operand n + 1
                    name = call.operands[call.called.index(called) + 1]
                else:
                    name = call.operands[int(instruction.operands[0])]
            else:
                return computation, instruction
        return None


def _parse_instruction(line: str, index: int) -> Instruction | None:
    head = _INSTRUCTION.match(line)
    if head is None:
        return None
    at = head.end()
    if line[at] == "(":  # a tuple shape: up to its closing parenthesis
        end = _closing(line, at)
        shape, at = line[at:end + 1], end + 2
    else:
        end = line.index(" ", at)
        shape, at = line[at:end], end + 1
    opcode_end = line.index("(", at)
    opcode = line[at:opcode_end]
    close = _closing(line, opcode_end)
    operands = [_operand_name(o) for o in _split_top(line[opcode_end + 1:close])]
    return Instruction(head.group(2), shape, opcode, [o for o in operands if o], line[close + 1:], index)


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start` (brackets of every kind nest; quoted text is skipped)."""
    depth, quoted = 0, False
    for i in range(start, len(text)):
        c = text[i]
        if c == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def tuple_elements(shape: str) -> list[str]:
    """A tuple shape's top-level element shapes; an array shape is its own one element."""
    return _split_top(re.sub(r"/\*.*?\*/", "", shape[1:-1])) if shape.startswith("(") else [shape]


def _split_top(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _operand_name(text: str) -> str | None:
    """`%x`, `bf16[4]{0} %x` or `%x#1` -> "x" / "x#1"; a parameter's number or a literal -> itself."""
    text = re.sub(r"/\*.*?\*/", "", text).strip()
    token = text.split()[-1] if text else ""
    return token.lstrip("%") if token else None
