"""The server's own settings (the engine's are `EngineArgs`): security, limits, chat templates, reasoning,
the Responses API store, shutdown, and how uvicorn listens (TLS, root path, logging)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far more than any prompt a model's context can hold as JSON
# A request's line and headers together: nginx's default total (4 buffers of 8 KiB); h11 allows 16 KiB.
DEFAULT_MAX_HEADER_BYTES = 32 << 10
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # required as `Authorization: Bearer <key>` on every path but /health
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API; none by default
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # a larger request head gets 431 (server/http/connection.py)
    # vLLM's --enable-request-id-headers: a request's X-Request-Id becomes its response `id` and its engine
    # request id (an unusable one is a 400); without it the header is only echoed back.
    enable_request_id_headers: bool = False
    # Requests waiting for a slot beyond the running ones; more get 429 (None: no limit).
    max_queued_requests: int | None = 256
    shutdown_timeout: float = 30.0  # seconds running requests may finish after SIGTERM before being aborted
    chat_template: str | None = None  # the server's template (text); default: the model's own
    trust_request_chat_template: bool = False  # let a request carry its own `chat_template`
    chat_template_timeout: float = 2.0  # seconds one template rendering may take
    # Sampling defaults for fields a request leaves unset (--generation-config auto: the model's
    # generation_config.json): temperature, top_p, top_k, min_p, repetition_penalty, max_tokens.
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    # tool_choice "auto": find the tool calls a reply holds with this parser (server/tools/parsers.py);
    # None: "auto" is refused, as vLLM refuses it without --enable-auto-tool-choice.
    tool_call_parser: str | None = None
    # Report ready (/health 200) once one step program can run every step and compile the others while
    # serving (steps use the next bigger ready program meanwhile); False: only when all are compiled.
    background_warmup: bool = True
    # Split replies into thinking (`reasoning_content`) and answer (server/replies/reasoning.py): qwen3, deepseek_r1.
    reasoning_parser: str | None = None
    # Draw the seed of every request that gives none from this seed (vLLM's --seed): the same requests in the
    # same order sample the same tokens after a restart. None: fresh randomness.
    seed: int | None = None
    # Responses the Responses API keeps for previous_response_id, least recently used dropped first (0: none).
    responses_store_size: int = 256
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False
    # uvicorn: the ASGI root path behind a proxy that strips a prefix, TLS, its log level, the access log.
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    uvicorn_log_level: str = "info"
    log_requests: bool = True

    def __post_init__(self):
        if self.max_request_body_bytes < 1024:
            raise ValueError(f"max_request_body_bytes must be at least 1024, got {self.max_request_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.tool_call_parser is not None:
            from server.tools.parsers import get_parser
            get_parser(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            from server.replies.reasoning import ReasoningParser
            ReasoningParser(self.reasoning_parser)  # ValueError naming the choices
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one, got {self.root_path!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        for path in (self.ssl_keyfile, self.ssl_certfile):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS file {path!r} does not exist")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}")


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")
    return value
