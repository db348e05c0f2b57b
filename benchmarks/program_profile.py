"""A static profile of the engine's step program for a chip that is not here: every kernel, its bytes, its
layer, its time at the chip's roofline, against the least a step must move.

1. The engine's real step program for a model's config.json (no weights: `jaxserve plan`'s path,
   `engine/sizing.py`), one token bucket (default: the decode bucket, the smallest holding every sequence),
   compiled for `--target` by its own compiler here; on a GPU with XLA's dump on, for the launch sequence,
   and with the autotuning results a lease brought back from that chip where there are some
   (`--autotune-results`, benchmarks/autotune/<chip>.txt): without them the GEMMs take untuned tiles.
2. `jaxserve/execution/program_profile.py` reads the compiled HLO (and on a GPU the thunk sequence): each
   kernel in launch order, its bytes in and out, whether a command buffer (CUDA graph) runs it or the host
   launches it, its layer, its time estimate; a TPU's fusions, Mosaic calls and copies.
3. The minimum, from the model's parameters and config alone (`engine/roofline.py`'s `StepWork`): the weights
   read once, every sequence's KV read (`--context` tokens each), one token's KV written per sequence (every
   row of a bucket larger than --max-num-seqs: a prefill program).
4. A table (per step, per layer, before and after the layers, by kind, the busiest kernels with their share of
   the step) or `--json`; `--all` lists every kernel in launch order.

    ./dev run python benchmarks/program_profile.py --target h200 --layers 8 [--quantization int8]
        [--max-num-seqs 16] [--bucket 16] [--context 1024] [--model DIR] [--layer-loop scan] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: no device of this machine is used

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "configs" / "llama-3-8b"
AUTOTUNE_DIR = ROOT / "benchmarks" / "autotune"  # a lease's results per chip: h200.txt, h100.txt (README.md there)


def parse_args(argv=None) -> argparse.Namespace:
    from jaxserve.entrypoints.args import add_engine_args
    from sharding.chips import TARGET_HELP
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="h200", help=TARGET_HELP)
    p.add_argument("--layers", type=int, help="override the config's num_hidden_layers (a shallower model of its shape)")
    p.add_argument("--bucket", type=int, help="token bucket to compile (default: the decode bucket)")
    p.add_argument("--context", type=int, default=1024, help="tokens of KV each sequence attends to (default 1024)")
    p.add_argument("--branches", default="cheapest", choices=["cheapest", "costliest"],
                   help="which branch of each conditional counts: cheapest (default: a plain step, where no request "
                        "asked for log-probs, penalties or a grammar) or costliest")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all", action="store_true", help="list every kernel in launch order")
    p.add_argument("--top", type=int, default=12, help="busiest kernels to list (default 12)")
    p.add_argument("--autotune-results", default="auto", metavar="FILE|auto|none",
                   help="XLA's autotuning results from a lease on the chip (what benchmarks/gpu_session.sh brings "
                        "back): the GEMMs compile with the tiles and backend tuned there, not untuned defaults; "
                        f"GPU targets only (auto, the default: {AUTOTUNE_DIR.relative_to(ROOT)}/<chip>.txt where "
                        "the repository has one)")
    p.add_argument("--autotune-complete", action="store_true",
                   help="fail the compile where a GEMM fusion finds no entry in the results (XLA's "
                        "xla_gpu_require_complete_aot_autotune_results): whether the file's keys (the GPU, the "
                        "fusions, the XLA release) match this compile, which otherwise falls back to untuned tiles "
                        "without a word")
    add_engine_args(p)
    p.set_defaults(model=str(DEFAULT_MODEL), max_num_seqs=16, max_model_len=2048)
    return p.parse_args(argv)


def model_dir(a: argparse.Namespace, scratch: Path) -> str:
    """`--model`, or a copy of its config.json with `--layers` layers."""
    if a.layers is None:
        return a.model
    config = json.loads((Path(a.model) / "config.json").read_text())
    config["num_hidden_layers"] = a.layers
    (scratch / "model").mkdir()
    (scratch / "model" / "config.json").write_text(json.dumps(config))
    return str(scratch / "model")


def autotune_file(a: argparse.Namespace, target) -> Path | None:
    """The results file `--autotune-results` names for `target` (auto: the repository's for its chip, if any)."""
    if a.autotune_results == "none" or (a.autotune_results == "auto" and target.chip.is_tpu):
        return None
    if target.chip.is_tpu:
        raise SystemExit("--autotune-results: XLA autotunes GPU programs only; a TPU target takes none")
    if a.autotune_results == "auto":
        path = AUTOTUNE_DIR / f"{target.chip.name}.txt"
        return path if path.exists() else None
    return Path(a.autotune_results)


def run(a: argparse.Namespace) -> dict:
    """Compile and profile the program `a` names: the report `--json` prints."""
    import jax

    from jaxserve.engine.builder import build_abstract
    from jaxserve.engine.roofline import StepWork
    from jaxserve.engine.sizing import compiler_name, default_parallel, device_limit, step_programs
    from jaxserve.entrypoints.args import engine_args_from
    from jaxserve.execution.kv_budget import KVShare, page_bytes
    from jaxserve.execution.program_profile import Assumptions, profile_program
    from jaxserve.execution.thunks import read_thunks
    from pallas_kernels.kv_quant import kv_quant_dtype
    from sharding import autotune
    from sharding.chips import parse_target
    from sharding.compile_only import compile_devices, compile_options

    target = parse_target(a.target)
    tuned = autotune_file(a, target)
    try:
        load, results = autotune.load_option(tuned) if tuned else ({}, None)
    except autotune.AutotuneFileError as e:
        raise SystemExit(f"--autotune-results: {e}") from None
    if a.autotune_complete:
        if not tuned:
            raise SystemExit("--autotune-complete: no autotuning results to hold the compile to (--autotune-results)")
        load[autotune.REQUIRE_COMPLETE_OPTION] = True
    with tempfile.TemporaryDirectory(prefix="program_profile_") as scratch:
        given, a.model = a.model, model_dir(a, Path(scratch))
        args = default_parallel(engine_args_from(a), target)
        a.model = given
        devices = compile_devices(target)
        built = build_abstract(args, devices, target.platform, device_limit(target.chip))
        programs = step_programs(built, args)
        buckets = sorted(programs.layouts)
        bucket = a.bucket or next(b for b in buckets if b >= args.max_num_seqs)
        if bucket not in programs.layouts:
            raise SystemExit(f"--bucket {bucket}: this engine's token buckets are {buckets}")
        layout, c, plan = programs.layouts[bucket], built.model_config, built.model.plan
        context = min(a.context, built.scheduler_config.max_model_len)
        options = dict(compile_options(target), **load)
        if not target.chip.is_tpu:
            options["xla_dump_to"] = str(Path(scratch) / "dump")  # the thunk sequence: what the GPU launches
        with jax.default_device(devices[0]):
            compiled = programs.lower(layout).compile(options)
        thunks = None if target.chip.is_tpu else read_thunks(Path(scratch) / "dump")
        flat, _ = jax.tree_util.tree_flatten_with_path(built.model.params)
        paths = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat]
        assumptions = Assumptions(layout.seqs, context, c.num_heads // plan.tp, c.head_dim,
                                  target.chip.hbm_bandwidth, target.chip.bf16_flops)
        profile = profile_program(compiled.as_text(), paths, assumptions, thunks, a.branches)

    share = KVShare.of(c, plan)
    kv_per_token = page_bytes(c, 1, kv_quant_dtype(args.kv_cache_dtype) or built.dtype, share)
    work = StepWork.of(built.model.params, c, target.chip, kv_per_token, plan.layers_per_stage,
                       c.num_heads // plan.tp, plan.pp)
    written = bucket if bucket > args.max_num_seqs else layout.seqs
    minimum = {"weights": work.dense_bytes + int(work.expert_bytes * work.expert_fraction(written)),
               "kv_read": layout.seqs * context * kv_per_token, "kv_written": written * kv_per_token}
    tuning = tuned and dict(file=str(tuned), entries=len(results.entries), devices=results.devices())
    return report(a, target, built, args, profile, minimum, bucket, layout.seqs, context, compiler_name(target),
                  tuning)


def report(a, target, built, args, profile, minimum: dict, bucket: int, sequences: int, context: int,
           compiler: str, autotune_results: dict | None = None) -> dict:
    import jax.numpy as jnp
    step, layers = profile.totals(), profile.by_layer()
    min_bytes = sum(minimum.values())
    kinds: dict[str, dict] = {}
    for k in profile.kernels:
        kind = kinds.setdefault(k.kind, {"kernels": 0, "bytes": 0, "seconds": 0.0})
        kind["kernels"] += k.runs
        kind["bytes"] += k.bytes * k.runs
        kind["seconds"] += k.seconds * k.runs
    quantization = built.model_config.linear_quantization
    return {
        "target": target.name, "chip": target.chip.description, "platform": profile.platform, "compiler": compiler,
        "model": str(a.model), "model_type": built.model_config.model_type, "layers": profile.layers,
        "dtype": jnp.dtype(built.dtype).name, "quantization": quantization and quantization.codes,
        "quantization_strategy": quantization and quantization.strategy,
        "kv_cache_dtype": args.kv_cache_dtype, "layer_loop": "scan" if profile.loop_trips else "unroll",
        "bucket": bucket, "sequences": sequences, "context": context, "branches": a.branches,
        "autotune_results": autotune_results,
        "kernels": step["kernels"], "kernels_per_layer": profile.kernels_per_layer(),
        "host_launched_kernels": step["host_launched_kernels"],
        "command_buffer_kernels": step["kernels"] - step["host_launched_kernels"] if profile.platform == "gpu" else 0,
        "command_buffers": step["command_buffers"],
        "bytes_per_step": step["bytes"], "min_bytes_per_step": min_bytes, "minimum": minimum,
        "est_step_seconds": step["seconds"], "min_step_seconds": min_bytes / target.chip.hbm_bandwidth,
        "bandwidth_bytes_s": target.chip.hbm_bandwidth, "peak_flops": target.chip.bf16_flops,
        "by_layer": layers, "by_kind": kinds,
        "flagged": [{"kernel": k.name, "layer": k.layer, "runs": k.runs, "flags": k.flags} for k in profile.kernels
                    if k.flags],
        "skipped_branches": profile.skipped,
        "kernel_list": [{"name": k.name, "kind": k.kind, "opcode": k.opcode, "layer": k.layer, "bytes_in": k.bytes_in,
                         "bytes_out": k.bytes_out, "flops": k.flops, "seconds": k.seconds, "runs": k.runs,
                         "in_command_buffer": None if profile.platform != "gpu" else k.command_buffer is not None,
                         "command_buffer": k.command_buffer, "where": k.where, "notes": k.notes, "flags": k.flags}
                        for k in profile.kernels],
    }


def render(r: dict, a: argparse.Namespace) -> str:
    gb, ms = (lambda n: f"{n / 1e9:.3f} GB"), (lambda s: f"{s * 1e3:.3f} ms")
    gpu = r["platform"] == "gpu"
    quant = f", {r['quantization']} weights ({r['quantization_strategy']})" if r["quantization"] else ""
    kv = r["dtype"] if r["kv_cache_dtype"] == "auto" else r["kv_cache_dtype"]
    loop = "under lax.scan" if r["layer_loop"] == "scan" else "unrolled"
    lines = [f"{Path(r['model']).name} ({r['model_type']}, {r['layers']} layers {loop}, {r['dtype']}{quant}, KV {kv}) "
             f"on {r['target']} ({r['chip']}), {r['compiler']}",
             f"program: token bucket {r['bucket']}; attention counted as {r['sequences']} sequence{'s' * (r['sequences'] != 1)} x {r['context']} "
             f"tokens of KV read; roofline {r['bandwidth_bytes_s'] / 1e12:.2f} TB/s, "
             f"{r['peak_flops'] / 1e12:.0f} TFLOP/s"]
    if gpu:
        tuned = r["autotune_results"]
        lines.append(f"GEMM tiles: tuned on a device ({tuned['file']}, {tuned['entries']} entries)" if tuned else
                     "GEMM tiles: XLA's untuned defaults (no autotuning results from a device loaded)")
    lines.append("")
    head = "| | kernels | " + ("host-launched | command buffers | " if gpu else "") + "bytes | est. time |"
    lines += [head, "|---" * (head.count("|") - 1) + "|"]

    def row(name: str, t: dict) -> str:
        launch = f"{t['host_launched_kernels']:g} | {t['command_buffers']} | " if gpu else ""
        return f"| {name} | {t['kernels']:g} | {launch}{gb(t['bytes'])} | {ms(t['seconds'])} |"

    step = {"kernels": r["kernels"], "host_launched_kernels": r["host_launched_kernels"],
            "command_buffers": r["command_buffers"], "bytes": r["bytes_per_step"], "seconds": r["est_step_seconds"]}
    lines.append(row("step", step))
    lines.append(f"| minimum | | {'| | ' if gpu else ''}{gb(r['min_bytes_per_step'])} | {ms(r['min_step_seconds'])} |")
    by_layer = r["by_layer"]
    numbered = [name for name in by_layer if name.isdigit()]
    if "layers" in by_layer:
        lines.append(row(f"a layer (scanned: the loop / {r['layers']})", by_layer["layers"]))
    elif numbered:
        typical = next(n for n in numbered if by_layer[n]["kernels"] == r["kernels_per_layer"])
        others = ", ".join(f"{n}: {by_layer[n]['kernels']:g}" for n in numbered
                           if by_layer[n]["kernels"] != r["kernels_per_layer"])
        lines.append(row(f"a layer ({typical}; kernels elsewhere: {others})" if others else
                         f"a layer (each of {numbered[0]}-{numbered[-1]})", by_layer[typical]))
    for name, what in (("pre", "before the layers"), ("post", "after: norm, LM head, sampling")):
        if name in by_layer:
            lines.append(row(f"{what}", by_layer[name]))
    m = r["minimum"]
    lines += ["", f"bytes {r['bytes_per_step'] / r['min_bytes_per_step']:.3f}x the minimum: weights "
                  f"{gb(m['weights'])} + KV read {gb(m['kv_read'])} + KV written {gb(m['kv_written'])}"]
    kinds = sorted(r["by_kind"].items(), key=lambda kv: -kv[1]["seconds"])
    share = lambda v: v["seconds"] / r["est_step_seconds"] if r["est_step_seconds"] else 0
    rest = [v for _, v in kinds if share(v) < 0.005]
    lines.append("by kind (kernels, bytes, share of the time): " + "; ".join(
        [f"{name} {v['kernels']:g} ({gb(v['bytes'])}, {share(v):.0%})" for name, v in kinds if share(v) >= 0.005]
        + ([f"others {sum(v['kernels'] for v in rest):g} ({gb(sum(v['bytes'] for v in rest))})"] if rest else [])))
    if not gpu:
        parts = tpu_parts(r["kernel_list"])
        lines.append("TPU program, a step: " + ", ".join(f"{n:g} {what}" for what, n in parts.items()))
    if r["skipped_branches"]:
        skipped = r["skipped_branches"]
        lines.append(f"conditionals: each counted by its {r['branches']} branch; {len(skipped)} other branch(es) not "
                     f"counted ({sum(s['kernels'] for s in skipped)} kernels, {gb(sum(s['bytes'] for s in skipped))})")
    flags: dict[str, list[dict]] = {}
    for f in r["flagged"]:
        flags.setdefault("; ".join(f["flags"]), []).append(f)
    for flag, found in flags.items():
        names = [f["kernel"] for f in found]
        where = ",".join(dict.fromkeys(f["layer"] for f in found))
        where = "the layer loop" if where == "layers" else f"layers {where}"
        lines.append(f"!! {flag}: {sum(f['runs'] for f in found)} a step, in {where}: {', '.join(names[:4])}"
                     + (f" and {len(names) - 4} more" if len(names) > 4 else ""))
    rows = [[k] for k in r["kernel_list"]] if a.all else busiest(r["kernel_list"])[:a.top]
    lines += ["", "every kernel in launch order:" if a.all else
              f"busiest kernels (alike ones across layers in one row: x count):",
              "| share | est. us | bytes in | bytes out | GFLOP | x | layers | " + ("graph | " if gpu else "")
              + "kernel | where / notes |", "|---:|---:|---:|---:|---:|---:|---|" + ("---|" if gpu else "") + "---|---|"]
    for group in rows:
        k, count = group[0], sum(g["runs"] for g in group)
        graph = ("host | " if k["command_buffer"] is None else f"{k['command_buffer']} | ") if gpu else ""
        share = k["seconds"] * count / r["est_step_seconds"] if r["est_step_seconds"] else 0
        layers = sorted({g["layer"] for g in group}, key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n))
        span = f"{layers[0]}-{layers[-1]}" if len(layers) > 2 and all(n.isdigit() for n in layers) else ",".join(layers)
        lines.append(f"| {share:.1%} | {k['seconds'] * 1e6:.2f} | {k['bytes_in']:,} | {k['bytes_out']:,} | "
                     f"{k['flops'] / 1e9:.2f} | {count} | {span} | {graph}{k['name']} ({k['kind']}) | "
                     f"{'; '.join(filter(None, [k['where'], *k['notes'], *k['flags']]))} |")
    return "\n".join(lines) + "\n"


def tpu_parts(kernels: list[dict]) -> dict[str, float]:
    """A TPU step's kernels by what runs them: XLA's fusions, Mosaic kernels, copies, DMAs into VMEM, the rest."""
    part = lambda op: ("fusions" if op == "fusion" else "Mosaic calls" if op == "custom-call:tpu_custom_call" else
                       "copies" if op.startswith("copy") else "asynchronous slices (DMAs)" if op.endswith("slice-start")
                       else "other ops")
    found = dict.fromkeys(["fusions", "Mosaic calls", "copies", "asynchronous slices (DMAs)", "other ops"], 0)
    for k in kernels:
        found[part(k["opcode"])] += k["runs"]
    return found


def busiest(kernels: list[dict]) -> list[list[dict]]:
    """Kernels alike in all but their layer (kind, bytes, FLOPs, what runs them), grouped; busiest first."""
    groups: dict[tuple, list[dict]] = {}
    for k in kernels:
        key = (k["kind"], k["bytes_in"], k["bytes_out"], k["flops"], k["command_buffer"] is None,
               re.sub(r"\S+ (body|condition|\w*branch)", r"\1", k["where"]), tuple(k["notes"] + k["flags"]))
        groups.setdefault(key, []).append(k)
    return sorted(groups.values(), key=lambda g: -sum(k["seconds"] * k["runs"] for k in g))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    r = run(a)
    sys.stdout.write(json.dumps(r, indent=1) + "\n" if a.json else render(r, a))
    if not a.json:
        print("Reproduce: ./dev run python " + shlex.join(["benchmarks/program_profile.py", *argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
