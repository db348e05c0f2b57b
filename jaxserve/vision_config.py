"""The vision encoders' configs, read from a vision-language checkpoint's `config.json`.

1. `vision_config(cfg)` picks the family by `model_type` and reads its `vision_config` part, with the
   defaults transformers fills in for keys hub files leave out: `SiglipConfig` (Gemma 3: the SigLIP tower,
   then the projector that pools its patches to `mm_tokens_per_image` tokens of the text width) or
   `QwenVisionConfig` (Qwen2.5-VL's windowed ViT and its patch merger).
2. Each validates itself once and derives the sizes the encoder's shapes come from (patches per side,
   pooling kernel, head size, merged-window size).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.config_families import text_config

# transformers' SiglipVisionConfig defaults (Gemma 3's hub configs name only the keys that differ).
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
# transformers' Qwen2_5_VLVisionConfig defaults.
QWEN_VISION_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                            in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                            window_size=112, out_hidden_size=3584, fullatt_block_indexes=(7, 15, 23, 31))


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """Gemma 3's vision tower (SigLIP, no pooling head) and multimodal projector."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    mm_tokens_per_image: int = 256
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides "
                             f"the {self.patches_per_side} patches per image side")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """The projector averages pool_kernel x pool_kernel patches into one token."""
        return self.patches_per_side // self.tokens_per_side


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision transformer: 3-D patch embedding, window attention with a few full-attention
    blocks, 2-D rotary positions, and the merger of merge_size x merge_size patches into one token."""
    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # in pixels
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / {self.num_heads} heads must give a head size "
                             f"that is a multiple of 4 (2-D rotary embedding)")
        if self.window_size % (self.spatial_merge_size * self.patch_size):
            raise ValueError(f"vision window_size {self.window_size} is not a multiple of spatial_merge_size * "
                             f"patch_size ({self.spatial_merge_size * self.patch_size})")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes {self.fullatt_block_indexes} outside 0..{self.depth - 1}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output token."""
        return self.spatial_merge_size ** 2

    @property
    def window_tokens(self) -> int:
        """A window's side in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def vision_config(cfg: dict[str, Any]) -> SiglipConfig | QwenVisionConfig:
    """The vision encoder's config of a vision-language checkpoint's config.json."""
    model_type = cfg.get("model_type")
    vision = cfg.get("vision_config") or {}
    if model_type == "gemma3":
        v = {**SIGLIP_DEFAULTS, **vision}
        return SiglipConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                            num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
                            image_size=v["image_size"], patch_size=v["patch_size"],
                            text_hidden_size=text_config(cfg)["hidden_size"],
                            mm_tokens_per_image=cfg.get("mm_tokens_per_image", 256), num_channels=v["num_channels"],
                            layer_norm_eps=v["layer_norm_eps"], hidden_act=v["hidden_act"])
    if model_type == "qwen2_5_vl":
        v = {**QWEN_VISION_DEFAULTS, **vision}
        rope = v.get("rope_parameters") or {}
        return QwenVisionConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                                depth=v["depth"], num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"],
                                patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                                spatial_merge_size=v["spatial_merge_size"], window_size=v["window_size"],
                                fullatt_block_indexes=tuple(v["fullatt_block_indexes"]),
                                in_channels=v["in_channels"], hidden_act=v["hidden_act"],
                                rope_theta=float(rope.get("rope_theta", 10000.0)))
    raise ValueError(f"model_type {model_type!r} has no vision encoder jaxserve runs (gemma3, qwen2_5_vl)")
