"""Command line: `jaxserve generate ...` (offline, one prompt), `jaxserve serve ...` (HTTP server) and
`jaxserve convert ...` (Hugging Face safetensors -> Orbax checkpoint).

Multi-host: start the same command on every host with `--distributed-coordinator HOST:PORT
--num-processes N --process-id I` (or `--distributed-coordinator auto` on Cloud TPU / SLURM). Process 0
prints the completion or serves HTTP; the others run its device steps and exit when it is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from jaxserve.engine_args import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model directory (default: built-in demo model)")
    g.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a directory with the tokenizer (tokenizer.json, tokenizer_config.json, chat template) "
                        "to use instead of the model's")
    g.add_argument("--revision", default=None,
                   help="refused: a Hugging Face Hub revision; jaxserve serves local directories, so check out "
                        "the revision you want and pass its directory")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs, help="sequences running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--page-size", "--block-size", type=int, default=EngineArgs.page_size,
                   help="tokens per KV page (--block-size is vLLM's name for it)")
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (default: every slot at full context)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV cache; the page count follows (instead of --num-pages)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device memory left free by the weights to give the KV cache "
                        "(devices without memory statistics, such as the CPU, keep the default)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the KV pages of prompt prefixes seen before (the default)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="recompute every prompt from its first token")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step: a token per running sequence plus prefill chunks "
                        "(default: 512 on CPU, 2048 on GPU/TPU)")
    g.add_argument("--token-buckets", default=None,
                   help="comma-separated token counts a step is padded to, one compiled program each "
                        "(default: 1,2,4,... up to --max-num-batched-tokens)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    g.add_argument("--max-logprobs", type=int, default=EngineArgs.max_logprobs,
                   help="top logprobs a request may ask for, per sampled and per prompt token")
    g.add_argument("--max-logit-bias", type=int, default=EngineArgs.max_logit_bias,
                   help="logit_bias / allowed_token_ids entries a request may carry")
    g.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="sampling defaults: 'auto' takes the model's generation_config.json (temperature, "
                        "top_p, top_k, min_p, repetition_penalty, max_new_tokens); 'vllm' uses none")
    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("device mesh and multi-host")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices that split each layer (attention heads, MLP columns, vocabulary)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages, each a contiguous block of layers")
    g.add_argument("--distributed-coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed ('auto': detect Cloud TPU / SLURM / MPI; "
                        "default: $JAX_COORDINATOR_ADDRESS or single-process)")
    g.add_argument("--num-processes", type=int, default=None, help="default: $JAX_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None, help="default: $JAX_PROCESS_ID")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from server.options import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, UVICORN_LOG_LEVELS, ServerOptions

    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--compilation-cache-dir", default="~/.cache/jaxserve/xla",
                   help="JAX persistent compilation cache, and jaxserve's compiled step programs in "
                        "jaxserve-programs/ inside it ('' to disable both)")
    g.add_argument("--warmup", choices=["background", "full"], default="background",
                   help="background (default): ready once one step program can serve every step, the other "
                        "buckets compile while serving; full: ready once every program is compiled")
    g.add_argument("--shutdown-timeout", type=float, default=ServerOptions.shutdown_timeout,
                   help="on SIGTERM, seconds running requests may finish before they are aborted")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a reverse proxy strips before forwarding (ASGI root_path), e.g. /llm")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    g.add_argument("--uvicorn-log-level", default=ServerOptions.uvicorn_log_level, choices=UVICORN_LOG_LEVELS)
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (uvicorn's access log)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed the draws of requests that give no seed: the same requests in the same order "
                        "sample the same tokens after a restart (default: fresh randomness)")
    g = parser.add_argument_group("security")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (or set $JAXSERVE_API_KEY)")
    g.add_argument("--allowed-origins", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins allowed by CORS, e.g. https://app.example.com ('*' for any); "
                        "default: none")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="a request's X-Request-Id header becomes the response's id (cmpl-ID, chatcmpl-ID) and "
                        "its engine request id; an id that is not 1-128 printable characters is a 400")
    g = parser.add_argument_group("request limits")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are read")
    g.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                   help="request line and headers together; a larger head gets 431 and the connection is "
                        "closed before more of it is read (default 32 KiB)")
    g.add_argument("--max-queued-requests", type=int, default=ServerOptions.max_queued_requests,
                   help="requests that may wait beyond the running ones (--max-num-seqs); more get 429 "
                        "with Retry-After. A list of prompts counts as that many requests")
    g = parser.add_argument_group("chat templates")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="jinja chat template (a file, or the text itself) instead of the model's own")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests carry their own chat_template (it runs on the server: off by default)")
    g = parser.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice 'auto' (the default when a request has tools) by parsing the "
                        "reply with --tool-call-parser; 'required' and a named tool work without it")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format: hermes, qwen, llama3_json or mistral")
    g = parser.add_argument_group("reasoning models and the Responses API")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return the <think>...</think> block as reasoning_content (chat) and reasoning items "
                        "(Responses API); structured outputs and tool calls apply to the answer after it")
    g.add_argument("--responses-store-size", type=int, default=ServerOptions.responses_store_size, metavar="N",
                   help="responses kept in memory for previous_response_id (least recently used dropped first; "
                        "0 keeps none)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    if getattr(ns, "revision", None) is not None:
        raise ValueError(f"--revision {ns.revision}: jaxserve loads local directories, not the Hugging Face Hub; "
                         f"download that revision (e.g. `hf download MODEL --revision {ns.revision} --local-dir "
                         f"DIR`) and pass --model DIR")
    if getattr(ns, "model_tag", None):  # `jaxserve serve MODEL`, as vllm serve takes it
        if ns.model not in (None, ns.model_tag):
            raise ValueError(f"the model is given twice: {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    if kwargs.get("token_buckets"):
        kwargs["token_buckets"] = tuple(int(b) for b in kwargs["token_buckets"].split(","))
    return EngineArgs(**kwargs)


def _generate(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams

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


def _serve(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
    from sharding.multihost import initialize, is_leader
    if initialize(args.distributed_coordinator, args.num_processes, args.process_id) and not is_leader():
        # Followers never import the HTTP stack: they run process 0's steps until it shuts down.
        from jaxserve.engine import Engine
        engine = Engine(args)
        engine.warmup()
        engine.follow()
        return 0
    from server.serve import serve
    return serve(args, host=ns.host, port=ns.port, compilation_cache_dir=ns.compilation_cache_dir,
                 options=server_options_from(ns, args))


def server_options_from(ns: argparse.Namespace, args: EngineArgs):
    from jaxserve.engine_args import sampling_defaults
    from server.options import ServerOptions, read_chat_template
    return ServerOptions(
        api_key=ns.api_key or os.environ.get("JAXSERVE_API_KEY") or None,
        allowed_origins=tuple(o.strip() for o in (ns.allowed_origins or "").split(",") if o.strip()),
        max_request_body_bytes=ns.max_request_body_bytes, max_queued_requests=ns.max_queued_requests,
        max_header_bytes=ns.max_header_bytes, enable_request_id_headers=ns.enable_request_id_headers,
        shutdown_timeout=ns.shutdown_timeout, background_warmup=ns.warmup == "background",
        chat_template=read_chat_template(ns.chat_template),
        trust_request_chat_template=ns.trust_request_chat_template,
        tool_call_parser=_tool_call_parser(ns), reasoning_parser=ns.reasoning_parser,
        responses_store_size=ns.responses_store_size, seed=ns.seed,
        root_path=ns.root_path, ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile,
        uvicorn_log_level=ns.uvicorn_log_level, log_requests=not ns.disable_log_requests,
        sampling_defaults=sampling_defaults(args.model, ns.generation_config))


def _tool_call_parser(ns: argparse.Namespace) -> str | None:
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen, llama3_json or mistral)")
    if ns.tool_call_parser and not ns.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser is used by tool_choice 'auto': add --enable-auto-tool-choice")
    return ns.tool_call_parser


def _convert(ns: argparse.Namespace) -> int:
    from jaxserve.checkpoint import convert
    from sharding import ParallelConfig
    from sharding.multihost import initialize
    initialize(ns.distributed_coordinator, ns.num_processes, ns.process_id)
    convert(ns.model, ns.output, ns.dtype, ParallelConfig(ns.tensor_parallel_size, ns.pipeline_parallel_size),
            format=ns.format)
    sys.stdout.write(f"{ns.output}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
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

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="model directory (the same as --model; default: built-in demo model)")
    add_engine_args(srv)
    add_server_args(srv)
    srv.set_defaults(func=_serve)

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
    add_parallel_args(conv)
    conv.set_defaults(func=_convert)

    from jaxserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.argv = sys.argv[1:] if argv is None else list(argv)  # reports quote the command that made them
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return ns.func(ns)
    except (ValueError, OSError, ImportError) as e:  # ImportError: an optional dependency is missing
        parser.exit(2, f"jaxserve: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
