"""A static profile of a compiled step program: every kernel, the bytes it moves, its layer, its roofline time.

1. The kernels, in launch order. On a GPU from XLA's thunk sequence (`thunks.py`): which run inside a
   command buffer (a CUDA graph, launched once) and which the host launches one by one; a loop's condition
   and body counted per trip (the condition once more). On a TPU the program is one launch: its kernels are
   the scheduled HLO's fusions, Mosaic calls, copies and other array ops in order (scalar bookkeeping left
   out), a loop's body per trip.
2. Each kernel measured from the HLO (`kernel_bytes.py`): bytes in and out as it touches them (in-place KV
   writes as their rows, an attention kernel's KV reads as `Assumptions.sequences x context` tokens),
   FLOPs, time at the chip's roofline; a copy of a KV-pool-sized buffer flagged.
3. Layers: the entry parameter a kernel reads names a weight (`param_paths`: the step's flattened
   parameters in order); the first kernel computing on layer i's weights starts layer i (copies and other
   asynchronous starts do not: a TPU prefetches a layer's weights during the one before), the first reading
   a weight outside the layers after the last one starts "post" (final norm, LM head, sampling), and what
   comes before layer 0 is "pre". A scanned program's layer loop (the `while` carrying stacked layer
   weights) is "layers": one period of them, counted per trip.
4. A conditional runs one branch, chosen by data: `branches="cheapest"` counts each one's branch of fewest
   bytes, a plain step's (the engine's conditionals skip what no request in the step asked for: log-probs,
   penalties, grammar masks), "costliest" its branch of most; the others are listed in `Profile.skipped`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

from jaxserve.execution.hlo_text import Computation, HloModule, arrays
from jaxserve.execution.kernel_bytes import Assumptions, Kernel, KernelMeter
from jaxserve.execution.thunks import Thunk

__all__ = ["Assumptions", "Kernel", "Profile", "profile_program", "BRANCHES"]

# TPU opcodes that are no kernel of their own: values passed along, waits, markers.
_BOOKKEEPING = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                          "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "call-update"})
_TPU_KERNELS = frozenset({"fusion", "custom-call", "copy", "copy-start", "convolution", "dot"})
_LAYER = re.compile(r"(?:^|/)layers/(\d+)(?:/|$)")
BRANCHES = {"cheapest": min, "costliest": max}


@dataclasses.dataclass
class Profile:
    platform: str  # gpu or tpu
    kernels: list[Kernel]
    skipped: list[dict]  # conditional branches not counted: {where, kernels, bytes}
    layers: int  # the model's layers on this device
    loop_trips: int  # a scanned program's layer-loop trips (0: layers unrolled)

    def totals(self, kernels: list[Kernel] | None = None) -> dict:
        kernels = self.kernels if kernels is None else kernels
        host = sum(k.runs for k in kernels if k.command_buffer is None) if self.platform == "gpu" else 0
        return {"kernels": sum(k.runs for k in kernels), "host_launched_kernels": host,
                "command_buffers": len({k.command_buffer for k in kernels if k.command_buffer is not None}),
                "bytes": sum(k.bytes * k.runs for k in kernels),
                "seconds": sum(k.seconds * k.runs for k in kernels)}

    def by_layer(self) -> dict[str, dict]:
        """pre, each layer (or "layers": a scanned loop's share per layer), post: their totals."""
        groups: dict[str, list[Kernel]] = {}
        for k in self.kernels:
            groups.setdefault(k.layer, []).append(k)
        found = {name: self.totals(group) for name, group in groups.items()}
        if "layers" in found:
            found["layers"] = {key: value / self.layers if key != "command_buffers" else value
                               for key, value in found["layers"].items()}
        return found

    def kernels_per_layer(self) -> float:
        """The kernels of the most common layer (a scanned loop: per layer of its period)."""
        layers = self.by_layer()
        if "layers" in layers:
            return layers["layers"]["kernels"]
        counts = Counter(v["kernels"] for name, v in layers.items() if name.isdigit())
        return max(counts, key=lambda n: (counts[n], n)) if counts else 0


def profile_program(hlo_text: str, param_paths: list[str], assumptions: Assumptions,
                    thunks: list[Thunk] | None = None, branches: str = "cheapest") -> Profile:
    """The profile of a compiled program (`compiled.as_text()`): a GPU's with its thunk sequence
    (`thunks.read_thunks`), a TPU's without; `branches`: which branch of each conditional counts."""
    if branches not in BRANCHES:
        raise ValueError(f"branches must be one of {', '.join(BRANCHES)}, got {branches!r}")
    module = HloModule.parse(hlo_text)
    walk = _Walk(module, KernelMeter(module, assumptions), BRANCHES[branches])
    kernels = walk.gpu(thunks) if thunks is not None else walk.tpu(module.entry)
    loops = {name: trips for name, trips in _layer_loops(walk.meter, param_paths).items()
             if any(_inside(k, name) for k in kernels)}
    _assign_layers(kernels, param_paths, set(loops))
    layers = len({int(m.group(1)) for p in param_paths for m in [_LAYER.search(p)] if m})
    trips = max(loops.values(), default=0)
    return Profile("gpu" if thunks is not None else "tpu", kernels, walk.skipped, layers * max(trips, 1), trips)


# ---- walking the program in launch order ---------------------------------------------------------------

class _Walk:
    def __init__(self, module: HloModule, meter: KernelMeter, pick):
        self.module, self.meter, self.pick = module, meter, pick
        self.skipped: list[dict] = []  # conditional branches not counted
        self.buffers = 0  # command buffers seen

    def gpu(self, nodes: list[Thunk], buffer: int | None = None, runs: int = 1, where: str = "") -> list[Kernel]:
        found: list[Kernel] = []
        for t in nodes:
            if t.kind == "kCommandBuffer":
                self.buffers += 1
                found += self.gpu(t.sections.get("", []), self.buffers - 1, runs, where)
            elif t.kind == "kWhile":
                located = self.module.find(t.name)
                trips = self._trips(located[1] if located else None)
                found += self.gpu(t.sections.get("condition", []), buffer, runs * (trips + 1),
                                  _within(where, f"{t.name} condition"))
                found += self.gpu(t.sections.get("body", []), buffer, runs * trips,
                                  _within(where, f"{t.name} body x{trips}"))
            elif t.kind == "kConditional":
                found += self._branch(t.name, {label: self.gpu(branch, buffer, runs, _within(where, f"{t.name} {label}"))
                                               for label, branch in t.sections.items()})
            elif not t.is_launch:
                for section in t.sections.values():
                    found += self.gpu(section, buffer, runs, where)
            else:
                kernel = self.meter.kernel(t.name, t.kind)
                kernel.runs, kernel.command_buffer, kernel.where = runs, buffer, where
                found.append(kernel)
        return found

    def tpu(self, computation: Computation, runs: int = 1, where: str = "") -> list[Kernel]:
        found: list[Kernel] = []
        for i in computation.instructions:
            op = i.opcode
            if op in _BOOKKEEPING or op.endswith("-done"):
                continue
            if op == "while":
                trips = self._trips(i)
                body = self.module.computations[i.attr("body").lstrip("%")]
                found += self.tpu(body, runs * trips, _within(where, f"{i.name} body x{trips}"))
            elif op == "conditional":
                labels = ["true", "false"] if i.attr("true_computation") else [f"branch {n}" for n in range(len(i.called))]
                found += self._branch(i.name, {label: self.tpu(self.module.computations[c], runs,
                                                               _within(where, f"{i.name} {label}"))
                                               for label, c in zip(labels, i.called)})
            elif op == "call":
                found += self.tpu(self.module.computations[i.called[0]], runs, where)
            elif op in _TPU_KERNELS or op.endswith("-start") or any(a.elements > 1 for a in arrays(i.shape)):
                kernel = self.meter.kernel(i.name)
                kernel.runs, kernel.where = runs, where
                found.append(kernel)
        return found

    def _trips(self, loop) -> int:
        trips = self.module.trip_count(loop) if loop is not None else None
        return 1 if trips is None else trips  # unknown: once (XLA knows the engine's loops' counts)

    def _branch(self, name: str, branches: dict[str, list[Kernel]]) -> list[Kernel]:
        if not branches:
            return []
        weigh = lambda ks: (sum(k.bytes * k.runs for k in ks), sum(k.runs for k in ks))
        chosen = self.pick(branches, key=lambda label: weigh(branches[label]))
        self.skipped += [{"where": f"{name} {label}", "kernels": weigh(ks)[1], "bytes": weigh(ks)[0]}
                         for label, ks in branches.items() if label != chosen]
        return branches[chosen]


def _within(where: str, part: str) -> str:
    return f"{where} / {part}" if where else part


def _inside(kernel: Kernel, loop: str) -> bool:
    return any(part.split(" ")[0] == loop for part in kernel.where.split(" / "))


# ---- layers -----------------------------------------------------------------------------------------------

def _layer_loops(meter: KernelMeter, paths: list[str]) -> dict[str, int]:
    """`while` instructions that carry stacked layer weights (a scanned program's layer loop): their trips."""
    loops = {}
    for computation in meter.module.computations.values():
        for i in computation.instructions:
            if i.opcode != "while":
                continue
            init = computation.by_name.get(i.operands[0])
            carried = init.operands if init is not None and init.opcode == "tuple" else i.operands
            if any(_LAYER.search(paths[w]) for o in carried for w in meter.weights_of_value(computation, o)):
                loops[i.name] = meter.module.trip_count(i) or 1
    return loops


def _assign_layers(kernels: list[Kernel], paths: list[str], loops: set[str]) -> None:
    """Label each kernel's layer (see the module docstring)."""
    in_loop = [any(_inside(k, loop) for loop in loops) for k in kernels]
    if any(in_loop):
        first = in_loop.index(True)
        for n, k in enumerate(kernels):
            k.layer = "layers" if in_loop[n] else "pre" if n < first else "post"
        return
    layer_of = lambda k: {int(m.group(1)) for w in k.weights for m in [_LAYER.search(paths[w])] if m}
    computes = lambda k: k.kind != "copy" and not k.kind.endswith("-start")  # a TPU prefetches weights early
    starts: dict[int, int] = {}  # layer -> its first reader that computes
    for n, k in enumerate(kernels):
        for layer in layer_of(k) if computes(k) else ():
            starts.setdefault(layer, n)
    last = max(starts.values(), default=len(kernels))
    post = next((n for n, k in enumerate(kernels) if n > last and computes(k) and k.weights and not layer_of(k)),
                len(kernels))
    boundaries = sorted((n, str(layer)) for layer, n in starts.items())
    for n, k in enumerate(kernels):
        k.layer = "post" if n >= post else next((label for start, label in reversed(boundaries) if start <= n),
                                                 "pre")
