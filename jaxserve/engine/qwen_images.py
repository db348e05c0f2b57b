"""Qwen2.5-VL's images in the engine: its encoder by buckets of patches, and each prompt's M-RoPE positions.

1. `patch_encoder(model_dir, config, encoder, dtype, device)` makes the ViT (`model/qwen_vit.py`) the encoder
   program (`execution/vision_patches.py`) whose buckets of patches (`encoder_buckets`) run from the smallest
   image the checkpoint's processor makes to its largest (max_pixels), so every image the processor accepts
   is encoded, as vLLM plans its encoder for the processor's largest image. The ViT's attention is dense within each segment,
   so a processor whose max_pixels would need more than `MAX_ENCODER_PATCHES` patches (the hub files' 12.8
   MP: 65536) gets buckets up to that many, with a warning: a larger image is then refused by its field.
2. `MRoPEImages` is the request side of it, at `EngineImages.attach`: each image's pixels as the program
   takes them (patches and grid; an image past the largest bucket is a 400 naming its field), and the
   prompt's M-RoPE positions (`model/mrope.PromptPositions`), computed once per request and read by the
   batch builder at every step of it, recomputations and prefix-cache hits included.
Qwen's image tokens attend causally: chunked prefill may cut through an image (no span ends, no whole images).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from jaxserve.errors import InvalidParameter
from jaxserve.execution.vision_patches import PatchedImage, PatchEncoderProgram, patch_buckets
from jaxserve.json_files import read_json_object
from jaxserve.model.mrope import PromptPositions
from jaxserve.multimodal.processor_config import processor_files, qwen_image_token_id, qwen_pixel_limits
from jaxserve.vision_config import QwenVisionConfig

logger = logging.getLogger(__name__)

# 8192 patches (about 1.6 megapixels, 2048 image tokens): the dense attention of the ViT's full-attention blocks
# holds heads x 8192^2 float32 scores (4.3 GB for Qwen2.5-VL-7B's 16 heads).
MAX_ENCODER_PATCHES = 8192


def patch_limits(model_dir: str, config: QwenVisionConfig) -> tuple[int, int]:
    """(patches of the smallest, of the largest image) the checkpoint's processor makes: its sides are
    multiples of patch_size * merge_size and its pixels within (min_pixels, max_pixels)."""
    min_pixels, max_pixels = qwen_pixel_limits(processor_files(model_dir)[1])
    block = (config.patch_size * config.spatial_merge_size) ** 2
    return -(-min_pixels // block) * config.merge_unit, max_pixels // block * config.merge_unit


def encoder_buckets(model_dir: str, config: QwenVisionConfig) -> tuple[int, ...]:
    """The encoder programs' patch buckets for the checkpoint's processor (at most `MAX_ENCODER_PATCHES`)."""
    smallest, largest = patch_limits(model_dir, config)
    if largest > MAX_ENCODER_PATCHES:
        logger.warning("the image processor's max_pixels makes images of up to %d patches; the vision encoder's "
                       "programs take at most %d (larger images are refused: lower max_pixels in the "
                       "checkpoint's preprocessor_config.json to have them resized instead)", largest,
                       MAX_ENCODER_PATCHES)
        largest = MAX_ENCODER_PATCHES
    return patch_buckets(min(smallest, largest), largest, config.merge_unit)


def patch_encoder(model_dir: str, config: QwenVisionConfig, encoder, dtype, device) -> PatchEncoderProgram:
    return PatchEncoderProgram(encoder, config, dtype, encoder_buckets(model_dir, config), device)


def max_image_tokens(program: PatchEncoderProgram) -> int:
    return program.max_patches // program.config.merge_unit


@dataclasses.dataclass(frozen=True)
class MRoPEImages:
    """What a Qwen-VL engine adds to a request with images: the encoder's input and the M-RoPE positions."""
    image_token_id: int
    spatial_merge_size: int
    max_patches: int  # the encoder's largest bucket
    patch_size: int  # pixels on a patch's side

    @classmethod
    def for_model(cls, model_dir: str, program: PatchEncoderProgram) -> MRoPEImages:
        cfg = read_json_object(f"{model_dir}/config.json", required=True)
        return cls(qwen_image_token_id(cfg), program.config.spatial_merge_size, program.max_patches,
                   program.config.patch_size)

    def pixels(self, image) -> PatchedImage:
        """`image` (a `multimodal.prompt.PromptImage`) as the encoder takes it; InvalidParameter naming its field
        when it has more patches than the encoder's largest program."""
        patches = len(image.pixel_values)
        if patches > self.max_patches:
            side = self.patch_size
            raise InvalidParameter(image.field, f"{image.field}: the image has {patches} patches of {side} x {side} "
                                                f"pixels after resizing, more than the {self.max_patches} the vision "
                                                f"encoder takes in one call (send a smaller image)")
        return PatchedImage(image.pixel_values, tuple(image.grid_thw))

    def positions(self, prompt_ids: Sequence[int], images: Sequence) -> PromptPositions:
        try:
            return PromptPositions.of(prompt_ids, self.image_token_id, [tuple(i.grid_thw) for i in images],
                                      self.spatial_merge_size, max(i.offset + i.length for i in images))
        except ValueError as e:  # image tokens of two images that touch read as one run
            raise InvalidParameter(images[0].field, f"{images[0].field}: {e}") from None
