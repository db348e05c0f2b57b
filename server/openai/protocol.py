"""OpenAI-compatible request bodies (pydantic) of the completion and chat routes.

A body's shape is validated here, before anything reaches the engine: a body that fails is a 400 with
`{"error": {"message", "type", "param", "code"}}`. Every field has a type and a range that the engine can
hold; floats must be finite. What depends on the model and the engine's fixed sizes (token ids, top_k,
the logprob counts, a grammar) the engine checks, once per prompt (server/openai/sampling.py).

Every field of vLLM's completion and chat request models is either implemented or refused by name with a
400 (`_UNSUPPORTED`: a field that stays at its default is fine, any other value is refused); fields
nobody knows are ignored with a warning in the log, as vLLM does. `to_sampling_params` maps a request to
the engine's `SamplingParams`, the server's defaults (the model's generation_config) filling what the
request left out.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxserve.sampling.grammar import StructuredOutputsParams
from jaxserve.sampling.params import InvalidParameter, SamplingParams
from server.http.bodies import RequestBody
from server.http.errors import UnsupportedField

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: each is searched for in the text after every token
MAX_PROMPTS = 256  # prompts in one completion request (each also counts against the queue limit)

# Field -> (value that means "not used", why another value is refused).
_UNSUPPORTED = {
    "suffix": (None, "suffix is not supported"),
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens=false is not supported"),
    "bad_words": ([], "bad_words is not supported; use logit_bias"),
    "prompt_embeds": (None, "prompt_embeds is not supported"),
    "structural_tag": (None, "structural tags are not supported yet"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "kv_transfer_params": (None, "disaggregated serving (kv_transfer_params) is not supported"),
    "vllm_xargs": (None, "vllm_xargs extensions are not supported"),
    "mm_processor_kwargs": (None, "mm_processor_kwargs is not supported (the checkpoint's processor files rule)"),
    "max_repetition_pattern_size": (0, "repetition-pattern stopping is not supported"),
    "min_repetition_pattern_size": (0, "repetition-pattern stopping is not supported"),
    "repetition_min_count": (0, "repetition-pattern stopping is not supported"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, not only the last


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema and its name (`strict` is always honoured: the
    output follows the schema whatever it says)."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    json_schema: dict | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # llama.cpp's json_object with a JSON Schema

    @model_validator(mode="after")
    def _schema_when_needed(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise UnsupportedField("response_format", "response_format of type json_schema needs a json_schema")
        if self.type == "structural_tag":
            raise UnsupportedField("response_format", "response_format structural_tag is not supported yet")
        return self


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` field (one constraint; see jaxserve/sampling/grammar.py)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # nothing to fall back from: one grammar library serves every spec
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _no_structural_tag(self):
        if self.structural_tag is not None:
            raise UnsupportedField("structured_outputs", "structured_outputs.structural_tag is not supported yet")
        return self

    def spec(self, field: str = "structured_outputs") -> StructuredOutputsParams:
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties,
            whitespace_pattern=self.whitespace_pattern, field=field)


# vLLM's grammar backends: every one of them is served by llguidance here (the constraint is the same).
_GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer")


class _Request(RequestBody):
    """Fields common to both routes, in vLLM's names, types and defaults."""
    # NaN and infinities never pass: Python's JSON parser accepts them, the sampler must not see them.
    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    n: int = Field(default=1, ge=1, le=64)
    best_of: int | None = Field(default=None, ge=1, le=64)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=1024)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = Field(default=None, min_length=1, max_length=65536)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=1024)  # recorded by nobody: an id for abuse reports
    response_format: ResponseFormat | None = None
    request_id: str | None = Field(default=None, max_length=128)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # Prefix-cache isolation (vLLM's field): only requests with the same salt share cached KV pages.
    cache_salt: str | None = Field(default=None, min_length=1)
    # Refused unless at their default (see _UNSUPPORTED).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    bad_words: list[str] = Field(default_factory=list)
    structural_tag: Any = None
    # Structured outputs, in every spelling vLLM accepts (at most one per request): see structured_spec.
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    priority: int = 0  # --scheduling-policy priority: lower runs first (any other value is refused under fcfs)
    max_repetition_pattern_size: int = 0
    min_repetition_pattern_size: int = 0
    repetition_min_count: int = 0

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may be at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value):
        if value is None:
            return value
        if len(value) > 65536:
            raise ValueError("logit_bias has too many entries")
        for key, bias in value.items():
            if not key.lstrip("-").isdigit() or len(key) > 12:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, (default, why) in _UNSUPPORTED.items():
            if name in type(self).model_fields and getattr(self, name) != default:
                raise UnsupportedField(name, why)
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", "best_of other than n is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise UnsupportedField("prompt_logprobs", "prompt_logprobs are not available when streaming")
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in _GRAMMAR_BACKENDS:
            raise UnsupportedField("guided_decoding_backend", f"guided_decoding_backend must be one of "
                                   f"{', '.join(_GRAMMAR_BACKENDS)} (all are served by llguidance)")
        return self

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The request's output constraint, whichever field carries it; InvalidParameter naming the field
        when it is bad or when more than one field carries one."""
        specs = []
        if self.response_format is not None and self.response_format.type == "json_object":
            schema = self.response_format.schema_
            specs.append(StructuredOutputsParams(json_object=True, field="response_format") if schema is None
                         else StructuredOutputsParams(json=schema, field="response_format.schema"))
        elif self.response_format is not None and self.response_format.type == "json_schema":
            specs.append(StructuredOutputsParams(json=self.response_format.json_schema.json_schema,
                                                 field="response_format.json_schema"))
        if self.structured_outputs is not None:
            specs.append(self.structured_outputs.spec())
        ws = self.guided_whitespace_pattern
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                specs.append(StructuredOutputsParams(**{kind: getattr(self, name)}, whitespace_pattern=ws, field=name))
        if len(specs) > 1:
            raise InvalidParameter(specs[1].field, f"{specs[0].field} and {specs[1].field} both constrain the "
                                   f"output: give one")
        return specs[0] if specs else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, defaults: dict) -> SamplingParams:
        """`defaults`: the server's sampling defaults (the model's generation_config), used where the
        request leaves a field unset."""
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)
        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, max_tokens=max_tokens, min_tokens=self.min_tokens,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            cache_salt=self.cache_salt, structured_outputs=self.structured_spec())


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    add_special_tokens: bool = True
    suffix: str | None = None
    prompt_embeds: Any = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        if isinstance(prompt, list) and any(isinstance(p, list) and not p for p in prompt):
            raise ValueError("a prompt must not be an empty list of token ids")
        return prompt

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedField("max_tokens", "max_tokens may be 0 only with echo (to score the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list: one entry per prompt, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    """An OpenAI content part of text."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):  # unknown keys are ignored (pydantic's default), as in the parts above
    url: str = Field(min_length=1)  # data:image/...;base64,..., http(s)://..., or file://... (--allowed-local-media-path)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the checkpoint's processor decides the size


class ImageURLPart(BaseModel):
    """An OpenAI image part: `{"type": "image_url", "image_url": {"url": ...}}` (vision models only)."""
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool calls, names etc. pass through to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def for_template(self) -> dict:
        """The message as the chat template takes it: text parts joined, or, with images, the parts in
        order (jaxserve/multimodal/chat_parts.py turns the image parts into the template's shape)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and not any(isinstance(p, ImageURLPart) for p in self.content):
            data["content"] = "".join(part.text for part in self.content)
        # An earlier reply's tool calls come back with their arguments as JSON text (OpenAI's shape); chat
        # templates write them with `tojson` or iterate over them, so they get the object.
        for call in data.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    pass  # not JSON: the template gets the text as it came
        return data

    @property
    def text(self) -> str:
        """The message's text (its text parts, without images)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema for the arguments object
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value):
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON Schema of type object")
        return value


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False  # vLLM: the reply starts with the last message's content when that is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: bool | None = None  # several calls per reply (what `required` allows, and parsers read)
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # handed to the chat template
    include_reasoning: bool = True
    mm_processor_kwargs: Any = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs and self.top_logprobs > 0:
            raise UnsupportedField("top_logprobs", "top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise UnsupportedField("continue_final_message",
                                   "continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise UnsupportedField("continue_final_message", "continue_final_message needs a final assistant "
                                   "message to continue")
        if self.tool_choice is None:
            self.tool_choice = "auto" if self.tools else "none"  # OpenAI's default
        if self.tool_choice in ("auto", "none"):
            return self
        if not self.tools:
            raise UnsupportedField("tool_choice", "tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.named_tool() is None:
            raise UnsupportedField("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, which is "
                                   f"not among the tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or named (one given function)."""
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    def named_tool(self) -> FunctionDefinition | None:
        name = self.tool_choice.function.name
        return next((t.function for t in self.tools or () if t.function.name == name), None)

    def structured_spec(self) -> StructuredOutputsParams | None:
        """`required` and a named tool constrain the reply like a JSON Schema (server/tools/calls.py); that
        leaves no room for another constraint."""
        from server.tools.calls import tool_choice_spec
        spec, forced = super().structured_spec(), tool_choice_spec(self)
        if spec is not None and forced is not None:
            raise InvalidParameter("tool_choice", f"tool_choice {self.tool_mode} and {spec.field} both constrain "
                                   f"the reply: give one")
        return forced or spec

    def template_variables(self) -> dict:
        """What the chat template sees besides the messages."""
        variables = dict(self.chat_template_kwargs or {})
        for name in ("documents", "reasoning_effort"):
            if getattr(self, name) is not None:
                variables[name] = getattr(self, name)
        if self.tools:
            variables["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return variables
