"""`LoRARequest`: which adapter a request runs under, in vLLM's shape (`LoRARequest(name, id, path)`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what the server lists in /v1/models and a request names as its `model`
    lora_int_id: int  # unique per adapter (>= 1), as vLLM asks; with the path it names the adapter's KV pages
    lora_path: str  # the PEFT adapter folder

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:  # vLLM's short aliases
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
