"""`jaxserve serve`: the HTTP server's subcommand, registered in the CLI's `jaxserve.commands` entry-point
group (pyproject.toml), so that the engine's command line never imports the server.

1. `add_serve_parser` adds the subcommand with the engine's options and the server's own (listening,
   security, limits, chat templates, tool calling, reasoning models and the Responses API);
   `server_options_from` turns the latter into `ServerOptions`.
2. `_serve` starts the server on process 0 of a multi-host run; the other processes run its device steps
   without importing the HTTP stack. Nothing here imports JAX or the HTTP stack until the command runs.
"""

from __future__ import annotations

import argparse
import os

from jaxserve.engine_args import EngineArgs, sampling_defaults
from jaxserve.entrypoints.args import add_engine_args, engine_args_from
from server.options import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_HEADER_BYTES, UVICORN_LOG_LEVELS, ServerOptions,
                            read_chat_template)


def add_serve_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="model directory (the same as --model; default: the built-in stories260K)")
    add_engine_args(srv)
    add_server_args(srv)
    srv.set_defaults(func=_serve)


def add_server_args(parser: argparse.ArgumentParser) -> None:
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
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora; "
                        "also on with vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
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


def _serve(ns: argparse.Namespace) -> int:
    args = engine_args_from(ns)
    from jaxserve.engine.engine import serve_as_follower
    if serve_as_follower(args):  # multi-host: processes other than 0 never import the HTTP stack
        return 0
    from server.serve import serve
    return serve(args, host=ns.host, port=ns.port, compilation_cache_dir=ns.compilation_cache_dir,
                 options=server_options_from(ns, args))


def server_options_from(ns: argparse.Namespace, args: EngineArgs) -> ServerOptions:
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
        allow_runtime_lora_updating=ns.allow_runtime_lora_updating or _env_flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        root_path=ns.root_path, ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile,
        uvicorn_log_level=ns.uvicorn_log_level, log_requests=not ns.disable_log_requests,
        sampling_defaults=sampling_defaults(args.model_dir, ns.generation_config))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _tool_call_parser(ns: argparse.Namespace) -> str | None:
    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen, llama3_json or mistral)")
    if ns.tool_call_parser and not ns.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser is used by tool_choice 'auto': add --enable-auto-tool-choice")
    return ns.tool_call_parser
