"""What one kernel of a compiled program moves and computes, read from the HLO (`hlo_text.py`).

1. Bytes from the shapes of its operands and results, counting what it touches rather than what it is
   handed: an in-place update (a scatter or dynamic-update-slice into an operand, as the KV cache's writes
   are) writes its rows and reads nothing of the buffer; an operand that is only gathered or sliced from
   (here or in a fusion nested in this one) gives the slices' bytes; an operand given twice is read once;
   arrays in another memory space (a TPU's VMEM or SMEM) are not HBM traffic.
2. A KV pool (an entry parameter `state.kv_cache...`, [heads, pages, page size, ...]) handed to a custom call is
   an attention kernel's: it reads `Assumptions.sequences x context` tokens of it, not the pool; unless the
   call returns the pool in place (`output_to_operand_aliasing`: a kernel writing the step's K / V rows,
   pallas_kernels/kv_write_gpu.py), which writes one row a write slot and reads none. Anything else that
   reads or writes a whole KV-pool-sized buffer, a copy above all, counts whole and is flagged.
3. FLOPs of matrix products from each dot's (or convolution's) shapes, inside the fusions it runs too, and
   of attention from the assumption (2 a head, a dimension and a context token, against each pool); the
   kernel's time at the chip's roofline is max(bytes / bandwidth, FLOPs / peak).
4. The weights it reads: operands whose origin is an entry parameter `param_leaves[i]` (the step's
   flattened parameters, in order).
"""

from __future__ import annotations

import dataclasses
import math
import re

from jaxserve.execution.hlo_text import Computation, HloModule, Instruction, arrays, shape_bytes, tuple_elements

_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # opcode -> operand holding the rows written
_SLICING = frozenset({"gather", "dynamic-slice", "slice"})
_KINDS = {"copy": "copy", "copy-start": "copy", "custom-call": "custom call", "fusion": "fusion"}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What an attention kernel reads of the KV pools it is handed, and the chip's roofline."""
    sequences: int
    context: int  # tokens of KV each sequence attends to
    query_heads: int  # per device, for attention FLOPs
    head_dim: int
    bandwidth: float  # bytes / s
    peak_flops: float  # FLOP / s


@dataclasses.dataclass
class Kernel:
    name: str  # its HLO instruction
    kind: str  # gemm, attention, kv write, copy, fusion, custom call, or the HLO opcode
    bytes_in: int  # per run
    bytes_out: int
    flops: float
    seconds: float  # per run, at the roofline
    runs: int = 1  # per step (loops' trips)
    command_buffer: int | None = None  # GPU: which command buffer runs it, None where the host launches it
    where: str = ""  # the loops and branches it is in, outermost first
    layer: str = ""  # pre, 0 .. L-1, layers (a scanned period), post
    notes: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)  # what no step should do: whole KV pools moved
    weights: list[int] = dataclasses.field(default_factory=list)  # indices into the parameter paths
    opcode: str = ""  # its HLO opcode; a custom call's target after a colon ("custom-call:tpu_custom_call")

    @property
    def bytes(self) -> int:
        return self.bytes_in + self.bytes_out


class KernelMeter:
    """Measures the kernels of one compiled program."""

    def __init__(self, module: HloModule, assumptions: Assumptions):
        self.module, self.a = module, assumptions
        self.pools: dict[tuple[str, int], int] = {}  # (dtype, elements) of a KV pool -> tokens it holds
        self.weight_of: dict[str, int] = {}  # entry parameter -> index into the parameter paths
        for i in module.entry.instructions:
            if i.opcode != "parameter":
                continue
            leaf = re.fullmatch(r"param_leaves\[(\d+)\]", i.op_name) or re.match(r"param_leaves_(\d+)_", i.name)
            if leaf:
                self.weight_of[i.name] = int(leaf.group(1))
            elif re.match(r"(state[._])?kv_cache", i.op_name or i.name):  # the step state's pools
                (pool,) = arrays(i.shape)
                self.pools[pool.dtype, pool.elements] = pool.dims[1] * pool.dims[2]

    def kernel(self, name: str, thunk_kind: str = "") -> Kernel:
        """Kernel `name` (its HLO instruction), measured."""
        located = self.module.find(name)
        if located is None:  # a thunk XLA made without an instruction of its own
            return Kernel(name, thunk_kind, 0, 0, 0.0, 0.0, notes=["not in the HLO: bytes unknown"])
        computation, i = located
        target = i.attr("custom_call_target") if i.opcode == "custom-call" else None
        kernel = Kernel(name, _KINDS.get(i.opcode, i.opcode), 0, 0, 0.0, 0.0,
                        opcode=f"{i.opcode}:{target}" if target else i.opcode)
        kernel.bytes_in, kernel.bytes_out = self._bytes(computation, i, kernel)
        kernel.flops = self._flops(i)
        if kernel.kind == "attention":
            kernel.flops += self._attention_flops(computation, i)
        elif kernel.flops:
            kernel.kind = "gemm"
        kernel.seconds = max(kernel.bytes / self.a.bandwidth, kernel.flops / self.a.peak_flops)
        kernel.weights = [w for o in dict.fromkeys(i.operands) for w in self.weights_of_value(computation, o)]
        return kernel

    def weights_of_value(self, computation: Computation, name: str) -> list[int]:
        """The weight value `name` is (looking through what moves no data), as an index into the paths."""
        origin = self.module.origin(computation, name)
        return [self.weight_of[origin[1].name]] if origin and origin[0].entry and origin[1].name in self.weight_of \
            else []

    def _pool_tokens(self, shape: str) -> int | None:
        found = arrays(shape)
        return self.pools.get((found[0].dtype, found[0].elements)) if len(found) == 1 else None

    def _bytes(self, computation: Computation, i: Instruction, kernel: Kernel) -> tuple[int, int]:
        op = i.opcode
        shapes = {o: _operand_shape(computation, o) for o in dict.fromkeys(i.operands)}
        reads = {o: shape_bytes(s) for o, s in shapes.items()}
        written: dict[int, int] = {}  # output element -> bytes an in-place update writes there
        if op == "fusion":
            fused = self.module.computations[i.called[0]]
            for element, target, rows in _in_place_updates(fused):
                written[element] = rows
                reads[i.operands[target]] = 0
            for number, sliced in _sliced_reads(self.module, fused).items():
                reads[i.operands[number]] = min(reads[i.operands[number]], sliced)
        elif op in _IN_PLACE:
            written[0] = shape_bytes(shapes[i.operands[_IN_PLACE[op]]])
            reads[i.operands[0]] = 0
        outputs = tuple_elements(i.shape)
        if op.endswith("-start"):  # ((operands), output, context); a copy-start's is (target, source, context)
            outputs = outputs[:1] if op == "copy-start" else outputs[1:2] if len(outputs) > 2 else outputs
        if op in _SLICING or op.removesuffix("-start") in _SLICING:  # (an asynchronous slice: XLA:TPU's DMAs)
            reads[i.operands[0]] = min(reads[i.operands[0]], sum(map(_all_bytes, outputs)))
        if op == "custom-call":  # a kernel handed KV pools that it returns in place writes rows of them
            for n, number in _aliased_outputs(i).items():
                pool = shapes.get(i.operands[number], "") if number < len(i.operands) else ""
                if self._pool_tokens(pool):
                    written[n] = _write_slots(shapes) * shape_bytes(pool) // self._pool_tokens(pool)
                    reads[i.operands[number]] = 0
        bytes_out = sum(written.get(n, shape_bytes(s)) for n, s in enumerate(outputs))

        pools = [o for o, s in shapes.items() if self._pool_tokens(s)]
        whole = sum(shape_bytes(shapes[o]) for o in pools) + sum(shape_bytes(s) for s in outputs
                                                                  if self._pool_tokens(s))
        if kernel.kind == "copy" and (pools or any(self._pool_tokens(s) for s in outputs)):
            space = "" if whole else ", in VMEM"
            kernel.flags.append(f"COPIES A KV-POOL-SIZED BUFFER ({max(map(_all_bytes, outputs)):,} bytes{space})")
        elif written and pools:
            kernel.kind = "kv write"
            kernel.notes.append("in place: its rows, not the pool")
        elif op == "custom-call" and pools:
            kernel.kind = "attention"
            for o in pools:
                share = min(1.0, self.a.sequences * self.a.context / self._pool_tokens(shapes[o]))
                reads[o] = math.ceil(reads[o] * share)
            kernel.notes.append(f"KV read assumed: {self.a.sequences} seq x {self.a.context} tokens")
        else:
            if any(reads[o] and reads[o] == shape_bytes(shapes[o]) for o in pools):
                kernel.flags.append("READS A WHOLE KV POOL")
            if not written and any(self._pool_tokens(s) and shape_bytes(s) for s in outputs):
                kernel.flags.append("WRITES A WHOLE KV POOL")
        return sum(reads.values()), bytes_out

    def _flops(self, i: Instruction) -> float:
        """2 x output elements x contracted size of every dot and convolution in `i` and the fusions it runs."""
        total, stack, seen = 0.0, [(self.module.find(i.name)[0], i)], set()
        while stack:
            computation, instruction = stack.pop()
            if instruction.opcode in ("dot", "convolution"):
                total += _product_flops(computation, instruction)
            elif instruction.opcode == "custom-call" and "gemm" in (instruction.attr("custom_call_target") or ""):
                total += _library_gemm_flops(computation, instruction)
            if instruction.opcode != "fusion":
                continue
            for name in instruction.called:
                if name not in seen and name in self.module.computations:
                    seen.add(name)
                    called = self.module.computations[name]
                    stack += [(called, x) for x in called.instructions]
        return total

    def _attention_flops(self, computation: Computation, i: Instruction) -> float:
        pools = sum(1 for o in dict.fromkeys(i.operands) if self._pool_tokens(_operand_shape(computation, o)))
        return 2.0 * pools * self.a.sequences * self.a.context * self.a.query_heads * self.a.head_dim


def _aliased_outputs(i: Instruction) -> dict[int, int]:
    """A custom call's outputs that alias an operand (`output_to_operand_aliasing`): output -> operand number."""
    found = re.search(r"output_to_operand_aliasing=\{(.*?)\}(?:,\s*[a-z_]+=|$)", i.rest)
    pairs = re.findall(r"\{(\d*)\}:\s*\((\d+),", found.group(1)) if found else []
    return {int(out or 0): int(operand) for out, operand in pairs}


def _write_slots(shapes: dict[str, str]) -> int:
    """Rows a kernel writing KV pages in place writes: its write slots' count, the one int32 vector it is
    handed (the step's tokens)."""
    slots = [a.dims[0] for s in shapes.values() for a in arrays(s) if a.dtype == "s32" and len(a.dims) == 1]
    return max(slots, default=0)


def _operand_shape(computation: Computation, operand: str) -> str:
    base, _, element = operand.partition("#")
    producer = computation.by_name.get(base)
    if producer is None:
        return ""
    return tuple_elements(producer.shape)[int(element)] if element else producer.shape


def _all_bytes(shape: str) -> int:
    return sum(a.bytes for a in arrays(shape))


def _in_place_updates(fused: Computation) -> list[tuple[int, int, int]]:
    """(output element, fusion operand updated in place, bytes written) of each scatter or dynamic-update-slice
    that a fusion's output is, into one of its parameters."""
    root = fused.root
    outputs = [fused.by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    found = []
    for element, out in enumerate(outputs):
        out = _through_bitcasts(fused, out)
        if out is None or out.opcode not in _IN_PLACE:
            continue
        target = _through_bitcasts(fused, fused.by_name.get(out.operands[0]))
        if target is not None and target.opcode == "parameter":
            rows = shape_bytes(fused.by_name[out.operands[_IN_PLACE[out.opcode]]].shape)
            found.append((element, int(target.operands[0]), rows))
    return found


def _through_bitcasts(computation: Computation, i: Instruction | None) -> Instruction | None:
    while i is not None and i.opcode == "bitcast":
        i = computation.by_name.get(i.operands[0])
    return i


def _sliced_reads(module: HloModule, fused: Computation) -> dict[int, int]:
    """Fusion operand -> bytes read of it, for each parameter that is only gathered or sliced from (here or in a
    fusion nested in this one): the slices' bytes, wherever they are put."""
    found = {}
    for p in fused.instructions:
        if p.opcode == "parameter":
            sliced = _slice_bytes(module, fused, p.name)
            if sliced is not None:
                found[int(p.operands[0])] = sliced
    return found


def _slice_bytes(module: HloModule, computation: Computation, name: str) -> int | None:
    """Bytes the users of value `name` slice out of it, or None when one of them reads it whole."""
    frontier, total, root = [name], 0, computation.root
    while frontier:
        value = frontier.pop()
        if value == root.name or (root.opcode == "tuple" and value in root.operands):
            return None  # handed on whole (a nested fusion's output)
        for user, position in computation.users(value):
            if user.opcode == "bitcast":
                frontier.append(user.name)
            elif user.opcode in _SLICING and position == 0:
                total += _all_bytes(user.shape)
            elif user.opcode == "fusion":
                nested = module.computations[user.called[0]]
                inner = nested.parameter(position)
                sliced = _slice_bytes(module, nested, inner.name) if inner is not None else None
                if sliced is None:
                    return None
                total += sliced
            else:
                return None
    return total


def _product_flops(computation: Computation, i: Instruction) -> float:
    lhs = computation.by_name.get(i.operands[0])
    if lhs is None:
        return 0.0
    lhs_dims, out = arrays(lhs.shape)[0].dims, sum(a.elements for a in arrays(i.shape))
    if i.opcode == "dot":
        contracted = math.prod(lhs_dims[int(d)] for d in (i.attr("lhs_contracting_dims") or "{}").strip("{}").split(",")
                               if d)
    else:  # convolution: the lhs's feature dimension ('f' in dim_labels such as bf_io->bf), times the window
        # where it overlaps the input (XLA:TPU writes a product batched over heads as a convolution whose
        # window spans the heads over an input of one, padded: one window position holds data)
        labels = (i.attr("dim_labels") or "bf_io->bf").split("_")[0]
        contracted = lhs_dims[labels.index("f")] if "f" in labels else 1
        window = re.search(r"size=([\dx]+)", i.attr("window") or "")
        for d, size in enumerate(int(s) for s in window.group(1).split("x")) if window else ():
            contracted *= min(size, lhs_dims[labels.index(str(d))]) if str(d) in labels else size
        contracted //= int(i.attr("feature_group_count") or 1)
    return 2.0 * out * contracted


def _library_gemm_flops(computation: Computation, i: Instruction) -> float:
    """A cuBLAS gemm custom call's: its contracting dimensions are in its backend config."""
    lhs = computation.by_name.get(i.operands[0])
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.rest)
    if lhs is None or dims is None:
        return 0.0
    lhs_dims = arrays(lhs.shape)[0].dims
    contracted = math.prod(lhs_dims[int(d.strip('"'))] for d in dims.group(1).split(",") if d)
    return 2.0 * arrays(tuple_elements(i.shape)[0])[0].elements * contracted
