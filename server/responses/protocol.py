"""`POST /v1/responses` request bodies (OpenAI's Responses API, as vLLM serves it), and their translation
into the chat request the server already knows how to run.

1. `ResponsesRequest` validates the body. Every field of OpenAI's create call either works or is refused
   by name (`_UNSUPPORTED`: a field left unset is fine); vLLM's sampling extras (top_k, seed, stop,
   structured_outputs, ...) pass through to the chat request under the same names; others are ignored
   with a warning, as elsewhere.
2. `input_messages` and `to_chat` write the conversation as chat messages: `instructions` as the system
   message, then a previous response's stored conversation (`previous_response_id`), then `input` — a string, or
   items: messages (text parts), `function_call` items (an assistant turn's tool calls),
   `function_call_output` items (tool messages) and `reasoning` items (the next assistant turn's
   `reasoning_content`). Tools become chat tools, `text.format` a response_format, `max_output_tokens`
   max_tokens; the result is a `ChatCompletionRequest`, run by the chat route's own code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.http.bodies import RequestBody
from server.http.errors import APIError, UnsupportedField
from server.openai.protocol import INT32_MAX, FunctionDefinition

# Field -> (value that means "not used", why another value is refused).
_UNSUPPORTED = {
    "background": ((None, False), "background responses are not supported; stream, or wait for the reply"),
    "conversation": ((None,), "conversations are not supported; use previous_response_id"),
    "prompt": ((None,), "prompt templates are not supported; send input (and instructions)"),
    "max_tool_calls": ((None,), "max_tool_calls limits built-in tools, which this server does not run"),
    "context_management": ((None,), "context_management is not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "image": ((None,), "image generation is not supported"),
    "background_options": ((None,), "background responses are not supported"),
    "service_tier": ((None, "auto", "default"), "service tiers other than auto and default are not offered"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache lives in memory: only in_memory is offered"),
}
# vLLM's sampling extras, handed to the chat request under the same names (validated there).
PASSTHROUGH = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
               "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids", "cache_salt",
               "request_id", "priority", "structured_outputs", "skip_special_tokens", "include_stop_str_in_output",
               "chat_template", "chat_template_kwargs", "user")
_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat tool's function, flat."""
    type: Literal["function"]


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_when_needed(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema format needs a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _no_verbosity(self):
        if self.verbosity not in (None, "medium"):
            raise UnsupportedField("text", "text.verbosity other than medium is not supported")
        return self


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # handed to the template
    summary: Literal["auto", "concise", "detailed"] | None = None  # "auto": none is written
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @model_validator(mode="after")
    def _no_summaries(self):
        for name in ("summary", "generate_summary"):
            if getattr(self, name) not in (None, "auto"):
                raise UnsupportedField("reasoning", f"reasoning.{name}: summaries are not written; the thinking "
                                       f"comes back whole as a reasoning item (--reasoning-parser)")
        return self


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(max_length=4096)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[FunctionTool] = Field(default_factory=list, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(default=None, max_length=128)
    store: bool | None = True
    stream: bool | None = False
    stream_options: dict | None = None  # include_obfuscation: no padding is ever added
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = "disabled"
    safety_identifier: str | None = Field(default=None, max_length=1024)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)  # echoed: the prefix cache needs no key
    # Refused unless unset (see _UNSUPPORTED).
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    background_options: Any = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data):
        for tool in (data.get("tools") or []) if isinstance(data, dict) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise UnsupportedField("tools", f"tools of type {kind!r} are not supported: this server runs no "
                                       f"built-in tools; give function tools")
        choice = data.get("tool_choice") if isinstance(data, dict) else None
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise UnsupportedField("tool_choice", f"tool_choice of type {choice.get('type')!r} is not supported; "
                                   f"use none, auto, required or a function")
        return data

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value):
        for name in value or []:
            if name not in _INCLUDES:
                raise UnsupportedField("include", f"include {name!r} is not supported (only {', '.join(_INCLUDES)})")
        return value

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value):
        if value and any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
            raise ValueError("metadata keys may have 64 characters and values 512")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, (allowed, why) in _UNSUPPORTED.items():
            if getattr(self, name) not in allowed:
                raise UnsupportedField(name, why)
        if self.top_logprobs and not self.logprobs_requested:
            raise UnsupportedField("top_logprobs", 'top_logprobs needs include ["message.output_text.logprobs"]')
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options can only be set when stream is true")
        if isinstance(self.tool_choice, ToolChoiceFunction) and all(t.name != self.tool_choice.name
                                                                    for t in self.tools):
            raise UnsupportedField("tool_choice", f"tool_choice names {self.tool_choice.name!r}, which is not "
                                   f"among the tools")
        return self

    @property
    def logprobs_requested(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or {}) - set(PASSTHROUGH))

    def to_chat(self, conversation: list[dict], max_model_len: int) -> dict:
        """The chat request body (to validate as a ChatCompletionRequest) that runs this response on
        `conversation` (a stored one followed by input_messages(input)), after the instructions."""
        extra = self.model_extra or {}
        chat = {name: extra[name] for name in PASSTHROUGH if name in extra}
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        chat["messages"] = system + conversation
        chat.update(model=self.model, temperature=self.temperature, top_p=self.top_p,
                    max_tokens=self.max_output_tokens, stream=bool(self.stream),
                    parallel_tool_calls=self.parallel_tool_calls)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:  # "auto" is the default here, even without tools; "required" without them is refused
            chat["tool_choice"] = "none" if choice == "auto" and not self.tools else choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.json_schema, "description": fmt.description, "strict": fmt.strict}}
        if self.logprobs_requested:
            chat.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort,
                                            **(chat.get("chat_template_kwargs") or {})}
        if self.truncation == "auto":  # vLLM's meaning: keep the prompt's last tokens that fit
            keep = max_model_len - (self.max_output_tokens or 0)
            chat["truncate_prompt_tokens"] = keep if self.max_output_tokens and keep > 0 else -1
        return chat


def input_messages(value: str | list[dict]) -> list[dict]:
    """`input` as chat messages (see the module docstring). APIError naming the item on a bad one."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool messages that answer it
    thinking: str | None = None  # a reasoning item's text, for the next assistant turn

    def assistant_turn(where: str) -> dict:
        nonlocal thinking
        turn = {"role": "assistant", "content": None}
        if thinking is not None:
            turn["reasoning_content"], thinking = thinking, None
        messages.append(turn)
        return turn

    for i, item in enumerate(value):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: must be user, assistant, system or developer", param=f"{where}.role")
            turn = assistant_turn(where) if role == "assistant" else {"role": role}
            turn["content"] = _text(item.get("content"), f"{where}.content")
            if role != "assistant":
                messages.append(turn)
        elif kind == "function_call":
            call_id, name = _field(item, "call_id", where), _field(item, "name", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": _field(item, "arguments", where)}}
            names[call_id] = name
            last = messages[-1] if messages else None
            turn = last if last is not None and last["role"] == "assistant" and thinking is None \
                else assistant_turn(where)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _field(item, "call_id", where)
            tool = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), f"{where}.output")}
            if call_id in names:
                tool["name"] = names[call_id]
            messages.append(tool)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thinking = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item references are not supported; send the item itself",
                           param=f"{where}.type", code="unsupported_parameter")
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported (this server runs no built-in "
                                f"tools)", param=f"{where}.type", code="unsupported_parameter")
    return messages


def _field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
               "summary_text": "text", "reasoning_text": "text"}


def _text(content, where: str) -> str | list[dict]:
    """A message's content (a string, or text parts) as text; with `input_image` parts, chat content parts
    (text and `image_url`) in order. Other parts are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: a string or a list of content parts is required", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{where}.{j}.image_url: an input_image needs its image_url (file_id is not "
                                    f"supported)", param=f"{where}.{j}.image_url", code="unsupported_parameter")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        key = _TEXT_PARTS.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise APIError(400, f"{where}.{j}: {kind!r} parts are not supported: this server reads text and "
                                f"input_image parts", param=f"{where}.{j}.type", code="unsupported_parameter")
        parts.append({"type": "text", "text": part[key]})
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)
