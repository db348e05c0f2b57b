"""Command line: `jaxserve generate ...` (offline, one prompt), `jaxserve convert ...` (a Hugging Face
checkpoint in a faster format), `jaxserve plan ...` (will it fit on a TPU slice or GPUs),
`jaxserve bench ...`, and `jaxserve serve ...` (the HTTP server).

1. `build_parser` adds the engine's own subcommands, then every subcommand registered in the
   `jaxserve.commands` entry-point group (pyproject.toml): the HTTP server's `serve` (`server/cli.py`) and
   the benchmarks' `bench` (`jaxserve/bench/cli.py`), so this module imports neither.
2. `main` parses, sets up logging and runs the subcommand; bad options and inputs, and an engine that
   cannot start, exit with status 2 and one line on stderr (its last) that says what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from importlib.metadata import entry_points

from jaxserve.entrypoints.args import add_engine_args, add_parallel_args, engine_args_from
from jaxserve.entrypoints.plan import add_plan_parser
from jaxserve.errors import ACTIONABLE_ERRORS

DESCRIPTION = """LLM inference in JAX: `serve` an OpenAI-compatible HTTP API, `generate` a completion offline,
`convert` a checkpoint to a faster format, `plan` a deployment (will it fit on a TPU slice or GPUs, compiled
for them here), `bench` a server or the engine.

Multi-host: start the same command on every host with `--distributed-coordinator HOST:PORT --num-processes
N --process-id I` (or `--distributed-coordinator auto` on Cloud TPU / SLURM). Process 0 prints the
completion or serves HTTP; the others run its device steps and exit when it is done."""
COMMANDS_GROUP = "jaxserve.commands"  # entry points: NAME = "module:function", function(subparsers) adds NAME


def _generate(ns: argparse.Namespace) -> int:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling.params import SamplingParams

    args = engine_args_from(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                            max_tokens=ns.max_tokens, seed=ns.seed, stop=ns.stop or None,
                            stop_token_ids=[int(t) for t in (ns.stop_token_ids or "").split(",") if t.strip()],
                            ignore_eos=ns.ignore_eos)
    llm = LLM(**dataclasses.asdict(args))
    results = llm.generate([ns.prompt], params)
    if not results:  # a follower process in a multi-host run: process 0 prints
        return 0
    output = results[0].outputs[0]
    sys.stdout.write(output.text + "\n")
    logging.getLogger("jaxserve").info("%d tokens, finish_reason=%s", len(output.token_ids), output.finish_reason)
    return 0


def _convert(ns: argparse.Namespace) -> int:
    from jaxserve.loader.convert import convert
    from sharding import ParallelConfig
    from sharding.multihost import initialize
    initialize(ns.distributed_coordinator, ns.num_processes, ns.process_id)
    parallel = ParallelConfig(ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.enable_expert_parallel)
    convert(ns.model, ns.output, ns.dtype, parallel, format=ns.format, quantization=ns.quantization,
            quantize_lm_head=ns.quantize_lm_head, quantize_embedding=ns.quantize_embedding,
            linear_layout=ns.linear_layout)
    sys.stdout.write(f"{ns.output}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="stop string (repeat the flag for several); not part of the output")
    gen.add_argument("--stop-token-ids", default=None, metavar="ID[,ID...]", help="token ids that end the output")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS tokens")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="write a Hugging Face checkpoint in a format that --model serves: "
                                          "Orbax (for meshes) or mapped (the fastest start)")
    conv.add_argument("--model", required=True, help="Hugging Face model directory")
    conv.add_argument("--output", required=True, help="new directory for the converted checkpoint")
    conv.add_argument("--format", choices=["orbax", "mapped"], default="orbax",
                      help="orbax: any mesh restores the slices it needs; mapped: safetensors in the model's own "
                           "layout and dtype, 64-byte aligned, used in place from the page cache (on CPU no "
                           "copy at all)")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="stored precision (auto: the checkpoint's own)")
    conv.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8"],
                      help="store the linear layers quantized per output channel, as --quantization does at "
                           "every load (a pre-quantized checkpoint is stored as it is quantized, without this)")
    conv.add_argument("--quantize-lm-head", action="store_true",
                      help="with --quantization: the LM head quantized as well")
    conv.add_argument("--quantize-embedding", action="store_true",
                      help="with --quantization: the token embedding quantized as well (one scale per token)")
    conv.add_argument("--linear-layout", default="auto", choices=["auto", "model", "feature-major"],
                      help="with --format mapped: feature-major stores the linear layers [out, in] with q/k/v and "
                           "gate/up fused, as a CPU's fastest products read them, so a CPU start uses them in "
                           "place (elsewhere they are turned back at load); model keeps the model's own layout; "
                           "auto: feature-major when converting on a CPU a model that runs so there")
    add_parallel_args(conv)
    conv.set_defaults(func=_convert)

    add_plan_parser(sub)

    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = sys.argv[1:] if argv is None else list(argv)  # reports quote the command that made them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return ns.func(ns)
    except ACTIONABLE_ERRORS as e:  # e.g. ImportError: an optional dependency is missing
        parser.exit(2, f"jaxserve: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
