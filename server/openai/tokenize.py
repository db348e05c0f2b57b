"""Request bodies of vLLM's /tokenize and /detokenize (the completion and chat bodies are `protocol.py`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from server.http.errors import UnsupportedField
from server.openai.protocol import ChatMessage


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise UnsupportedField("prompt", "give exactly one of prompt and messages")
        return self

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})
