"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) into host arrays.

1. `read_adapter_config` checks the config against what the step can run: a LoRA (not DoRA, not another
   PEFT method), target modules among the projections the model's hook covers, a rank within
   `--max-lora-rank`, no `modules_to_save`, no bias; each refusal is a `LoRAError` naming the file and the
   reason.
2. `load_adapter` reads the tensors (`base_model.model.<module path>.lora_A.weight` [r, in] and
   `.lora_B.weight` [out, r]) into per-(layer, module) pairs in the step's layout, A as [in, r] and B as
   [r, out] with the scale (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA) folded into B, so the device
   computes `(x @ A) @ B` and nothing else. Shapes are checked against the base model's config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections the model's LoRA hook covers, by PEFT's (Hugging Face's) module names, with the block
# they live in (for tensor names) and their (in, out) sizes under a config.
MODULE_BLOCKS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
TARGET_MODULES = tuple(MODULE_BLOCKS)

_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the file and the reason."""


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a target projection of the base model."""
    h, q, kv, mlp = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h)}[module]


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter on the host, in the step's layout."""
    config: AdapterConfig
    # (layer, module) -> (A [in, r], B [r, out] * scale), float32
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _module_names(raw, file: Path) -> tuple[str, ...]:
    if isinstance(raw, str):  # PEFT also takes a regex over module paths; "all-linear" is its shorthand
        if raw == "all-linear":
            return TARGET_MODULES
        names = tuple(m for m in TARGET_MODULES if re.search(raw, f"model.layers.0.{MODULE_BLOCKS[m]}.{m}"))
        if not names:
            raise LoRAError(f"{file}: target_modules pattern {raw!r} matches none of {', '.join(TARGET_MODULES)}")
        return names
    if not isinstance(raw, list) or not raw:
        raise LoRAError(f"{file}: target_modules must be a non-empty list of module names, got {raw!r}")
    unknown = sorted(set(raw) - set(TARGET_MODULES))
    if unknown:
        raise LoRAError(f"{file}: target module(s) {', '.join(unknown)} are not supported "
                        f"(LoRA applies to {', '.join(TARGET_MODULES)})")
    return tuple(m for m in TARGET_MODULES if m in raw)


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's settings, or a LoRAError naming what makes it unservable."""
    path = Path(path)
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter path {path} is not a directory (a PEFT adapter folder with "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not file.is_file():
        raise LoRAError(f"{file} not found: a LoRA adapter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAError(f"{file} could not be read as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise LoRAError(f"{file}: expected a JSON object")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type {peft_type!r} is not supported (only LORA)")
    if raw.get("use_dora"):
        raise LoRAError(f"{file}: DoRA adapters (use_dora: true) are not supported")
    if raw.get("modules_to_save"):
        raise LoRAError(f"{file}: modules_to_save {raw['modules_to_save']} is not supported (the adapter "
                        "replaces whole modules; only LoRA deltas on the projections are served)")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise LoRAError(f"{file}: adapters that train biases (bias {raw.get('bias')!r}) are not supported")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise LoRAError(f"{file}: per-module rank_pattern / alpha_pattern is not supported")
    if raw.get("layers_to_transform") is not None or raw.get("layer_replication") is not None:
        raise LoRAError(f"{file}: layers_to_transform / layer_replication is not supported")
    if raw.get("fan_in_fan_out"):
        raise LoRAError(f"{file}: fan_in_fan_out (Conv1D layers) is not supported")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"{file}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(path=path, rank=rank, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")),
                         target_modules=_module_names(raw.get("target_modules"), file))


def load_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check an adapter for `model_config`'s base model; raise LoRAError on anything unservable."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    config = read_adapter_config(path, max_rank)
    file = config.path / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"{file} not found (.bin adapters are not read: convert them to safetensors)")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"{file} could not be read as safetensors: {e}") from e
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoRAError(f"{file}: tensor {name} is not a LoRA A/B weight of a decoder layer's projection")
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in config.target_modules or MODULE_BLOCKS[module] != block:
            raise LoRAError(f"{file}: tensor {name} is for a module outside target_modules")
        if layer >= model_config.num_layers:
            raise LoRAError(f"{file}: tensor {name} is for layer {layer}; the base model has "
                            f"{model_config.num_layers} layers")
        pairs.setdefault((layer, module), {})[which] = value
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{file}: layer {layer} {module} has lora_{''.join(pair)} but not both A and B")
        d_in, d_out = module_shape(model_config, module)
        a, b = pair["A"], pair["B"]
        if a.shape != (config.rank, d_in) or b.shape != (d_out, config.rank):
            raise LoRAError(f"{file}: layer {layer} {module}: lora_A {a.shape} / lora_B {b.shape} do not fit the "
                            f"base model (expected ({config.rank}, {d_in}) / ({d_out}, {config.rank}))")
        weights[(layer, module)] = (np.ascontiguousarray(a.T, np.float32),
                                    np.ascontiguousarray(b.T.astype(np.float32) * np.float32(config.scale)))
    if not weights:
        raise LoRAError(f"{file} holds no LoRA weights")
    return LoRAAdapter(config, weights)
