"""The served model as the handlers see it: its name, its limits, its tokenizer and its LoRA adapters.

1. The engine is built on its own thread after the app starts, so every fact is read from it when asked
   (handlers ask only once `require_ready` has passed); nothing here is copied at start.
2. `adapter_for(model)` is what a request's `model` names: None for the base model, a loaded LoRA adapter,
   or a 404 that lists what this server serves. The reply's `model` is the name the checked request runs
   under (`served_name`), so an adapter unloaded meanwhile cannot change it.
3. `image_inputs` reads the checkpoint's image processor once, when first asked (jaxserve/multimodal/).
4. `prompt_fits` refuses, before tokenizing, a text too long for the context; `truncate` applies a
   request's `truncate_prompt_tokens`.
"""

from __future__ import annotations

from jaxserve.builtin_models import describe as describe_model
from jaxserve.entrypoints.async_engine import AsyncEngine
from jaxserve.lora.manager import LoRAManager
from jaxserve.lora.request import LoRARequest
from jaxserve.multimodal.prompt import ImageInputs
from jaxserve.scheduling.validation import CheckedRequest
from jaxserve.text.tokenizer import Tokenizer
from server.http.errors import APIError


class ServedModel:
    def __init__(self, async_engine: AsyncEngine):
        self._async_engine = async_engine
        # Characters a text prompt may have before tokenizing it is pointless (see prompt_fits).
        self.max_prompt_chars: int | None = None
        self._image_inputs: ImageInputs | None = None

    @property
    def _engine(self):
        return self._async_engine.engine

    @property
    def name(self) -> str:
        return self._engine.model_name

    @property
    def root(self) -> str:
        """Where the weights came from: the model folder, or the built-in model's description."""
        args = self._engine.args
        return args.model_dir or describe_model(args.model)

    @property
    def runner(self) -> str | None:
        """"generate" or "pooling"; None until the engine is built."""
        return None if self._engine is None else self._engine.runner_type

    @property
    def max_model_len(self) -> int:
        return self._engine.scheduler_config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self._engine.scheduler_config.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self._engine.model_config.vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        """encode, decode, token_str and the chat template (`apply_chat_template`)."""
        return self._engine.tokenizer

    @property
    def image_inputs(self) -> ImageInputs:
        """The request side of images: the checkpoint's image processor (none for a text-only model), the
        media flags, the per-prompt limit."""
        if self._image_inputs is None:
            self._image_inputs = ImageInputs.from_args(self._engine.args, self.name)
        return self._image_inputs

    @property
    def takes_images(self) -> bool:
        return self.image_inputs.takes_images

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA adapters (None without --enable-lora): loaded, looked up, unloaded by name."""
        return self._engine.lora

    def adapter_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); a 404 for anything else."""
        if model is None or model == self.name:
            return None
        lora = self.lora.lookup(model) if self.lora is not None else None
        if lora is None:
            adapters = [r.lora_name for r in self.lora.names()] if self.lora is not None else []
            served = ", ".join(f"`{name}`" for name in [self.name, *adapters])
            raise APIError(404, f"The model `{model}` does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return lora

    def served_name(self, request: CheckedRequest) -> str:
        """The `model` a reply names: the adapter the request runs under, else the base model."""
        return self.name if request.lora is None else request.lora.request.lora_name

    def prompt_fits(self, text: str, param: str = "prompt") -> None:
        """Refuse, without tokenizing, a text that cannot fit the context: every token covers at most the
        vocabulary's longest token string, so the text has at least len(text) / that many tokens."""
        limit = self.max_model_len
        if self.max_prompt_chars is None:
            self.max_prompt_chars = limit * self.tokenizer.max_token_chars
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the {param} has "
                                f"{len(text)} characters, more than that many tokens can hold",
                           param=param, code="context_length_exceeded")

    def truncate(self, ids: list[int], keep: int | None, reserve: int = 1) -> list[int]:
        """truncate_prompt_tokens: keep the last `keep` tokens (-1: as many as the context holds with `reserve`
        tokens to spare: one to generate, none to embed)."""
        if keep is None:
            return ids
        keep = self.max_model_len - reserve if keep == -1 else keep
        return ids[-keep:] if keep else ids
