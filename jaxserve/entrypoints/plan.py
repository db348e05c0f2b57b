"""`jaxserve plan MODEL --target T [serve's flags]`: will it fit on that slice, and how fast can it be.

1. The engine's real step programs are built from MODEL's config.json alone (shapes, no weights) and
   compiled for the target by its own compiler, here, without the chips (`jaxserve/engine/sizing.py`);
   a progress bar shows the compiles.
2. The answer, as text or (`--json`) one object: per device the weights, a token's KV, the pool and its
   capacity, each compiled program's bytes, the chip's HBM; whether max_model_len x max_num_seqs fits
   (exit status 1 when not, with the smallest changes that make it fit); roofline floors from the chip's
   spec sheet (printed with the figures used).
3. `--install-compilers` installs the compile-only packages (libtpu, the CUDA plugin, ptxas) in a folder
   of their own and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxserve.entrypoints.args import add_engine_args, engine_args_from

EXIT_DOES_NOT_FIT = 1


def add_plan_parser(sub) -> None:
    from sharding.chips import TARGET_HELP
    plan = sub.add_parser("plan", help="will a model fit on a TPU slice or GPUs, and how fast can it be: its step "
                                       "programs compiled for the target here, without the chips",
                          description=__doc__.split("\n\n")[0])
    plan.add_argument("model_dir", nargs="?", metavar="MODEL", help="a model directory (only config.json is read)")
    plan.add_argument("--target", help=TARGET_HELP)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--programs", default="decode,largest",
                      help="step programs to compile: decode (the smallest holding every slot), largest (the "
                           "token budget), all, none; comma-separated (default: decode,largest)")
    plan.add_argument("--install-compilers", action="store_true",
                      help="install the TPU and GPU compilers (compile-only, ~1.1 GB) outside this environment "
                           "and exit")
    add_engine_args(plan)
    plan.set_defaults(func=run_plan)


def run_plan(ns: argparse.Namespace) -> int:
    if ns.install_compilers:
        from sharding.compile_only import install_compilers
        sys.stdout.write(f"{install_compilers()}\n")
        return 0
    ns.model = ns.model or ns.model_dir
    if not ns.model or not ns.target:
        raise ValueError("plan needs a model directory (MODEL or --model) and --target")
    from tqdm.auto import tqdm

    from jaxserve.engine.sizing import plan_target
    from sharding.chips import parse_target

    target = parse_target(ns.target)
    bars = []

    def progress(total: int):
        bars.append(tqdm(total=total, desc=f"Compiling for {target.name}", unit="program", file=sys.stderr))
        return bars[-1]

    plan = plan_target(engine_args_from(ns), target, ns.programs, progress)
    for bar in bars:
        bar.close()
    report = plan.to_json()
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if ns.json else render(report))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def render(r: dict) -> str:
    d, roof = r["per_device"], r["roofline"]
    gb = lambda n: f"{n / 1e9:.2f} GB"
    quant = (f", {r['quantization']} weights run {r['quantization_strategy'].replace('_', ' ')}"
             if r["quantization"] else "")
    lines = [
        f"{r['model']} ({r['model_type']}, {r['dtype']}{quant}, KV {r['kv_cache_dtype']}) on {r['target']}: "
        f"{r['devices']} x {r['chip']}" + (f" on {r['hosts']} hosts" if r["hosts"] > 1 else ""),
        f"  tensor parallel {r['parallel']['tensor']}, pipeline parallel {r['parallel']['pipeline']}; "
        f"max_model_len {r['max_model_len']}, max_num_seqs {r['max_num_seqs']}",
        f"per device: {gb(d['hbm_bytes'])} HBM, {gb(d['limit_bytes'])} for JAX's allocator",
        f"  weights          {gb(d['weights_bytes'])}",
        f"  KV pool          {gb(d['kv_pool_bytes'])} = {d['kv_pool_tokens']} tokens "
        f"({d['kv_bytes_per_token']} bytes a token)",
        f"  programs' own    {gb(d['total_bytes'] - d['weights_bytes'] - d['kv_pool_bytes'])} "
        f"(largest temp {gb(d['program_temp_bytes_max'])})",
        f"  total            {gb(d['total_bytes'])} of {gb(d['limit_bytes'])}",
        f"  KV capacity at {d['kv_capacity_utilization']:.2f} of the memory the weights leave: "
        f"{d['kv_capacity_tokens']} tokens = {d['kv_capacity_sequences']:.1f} full-context sequences",
        f"compiled {r['programs_compiled']} step program(s) with {r['compiler']}:",
    ]
    for p in d["programs"]:
        lines.append(f"  {p['tokens']:>5} tokens: arguments {gb(p['argument_bytes'])}, outputs {gb(p['output_bytes'])} "
                     f"({gb(p['alias_bytes'])} aliased), temp {gb(p['temp_bytes'])}; {p['compile_seconds']:.1f} s")
    steps = ", ".join(f"{n} seq {s * 1e3:.2f} ms" for n, s in roof["decode_step_s"].items())
    chip = roof["chip"]
    lines += [
        f"roofline floors ({chip['hbm_bandwidth_bytes_s'] / 1e9:.0f} GB/s, {chip['bf16_flops'] / 1e12:.0f} "
        f"TFLOP/s bf16 a chip: {chip['source']}):",
        f"  decode step at {roof['decode_context_tokens']} tokens of context: {steps}",
        f"  prefill {roof['prefill_tok_s']:,.0f} tokens/s",
        "fits" if r["fits"] else "does NOT fit; what would make it fit:",
    ]
    lines += [f"  - {a['flags']}: {a['why']}" if a["flags"] else f"  - {a['why']}" for a in r["advice"]]
    return "\n".join(lines) + "\n"
