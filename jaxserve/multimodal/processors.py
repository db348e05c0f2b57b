"""Images -> the encoder's inputs and the prompt's placeholder tokens, as each checkpoint's processor does it.

1. `image_processor(model_dir)` reads the checkpoint's processor files (`processor_config.py`:
   `preprocessor_config.json`, or the `image_processor` part of `processor_config.json`;
   `processor_config.json`, `tokenizer_config.json` and `config.json` for the token strings and ids) into
   its family's processor.
2. `preprocess(image)` turns one decoded image into a `ProcessedImage`: the pixels as the vision encoder
   takes them and how many placeholder tokens its embeddings fill (`image_ops.py` does the pixel steps).
   - Gemma 3: resized to the tower's fixed size (bilinear), rescaled, normalized: [3, S, S];
     `image_seq_length` (= mm_tokens_per_image) tokens. Pan-and-scan crops are not supported (refused).
   - Qwen2-VL / Qwen2.5-VL: resized (bicubic) to the size nearest the image's whose sides are multiples of
     patch_size * merge_size and whose pixel count lies between min_pixels and max_pixels (`smart_resize`),
     rescaled, normalized, cut into a (grid_t, grid_h, grid_w) grid of patches flattened as the patch
     embedding's 3-D convolution reads them (a still image repeated over the temporal patch), patches of
     one merge_size x merge_size block adjacent; grid_t * grid_h * grid_w / merge_size^2 tokens.
3. `expand_prompt(prompt, images)` replaces each image's placeholder in the rendered chat prompt by its
   token sequence, on text as the processor does (so tokenization matches it): Gemma 3's
   `<start_of_image>` becomes "\\n\\n<start_of_image>" + the image tokens + "<end_of_image>\\n\\n"; Qwen's
   `<|image_pad|>` is repeated.
4. `placeholder_ranges(token_ids, images)` finds, after tokenization, where each image's embeddings go
   ((offset, length) per image), and refuses a prompt whose image tokens do not match its images (image
   token strings typed into the text, a truncated prompt).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from jaxserve.config_families import GEMMA3_VISION_TYPES, QWEN_VL_TYPES
from jaxserve.errors import InvalidParameter
from jaxserve.multimodal.image_ops import Normalization, rescale_normalize, resize, to_rgb
from jaxserve.multimodal.processor_config import processor_files, qwen_image_token_id, qwen_pixel_limits

IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as its encoder takes it."""
    pixel_values: np.ndarray  # float32: Gemma 3 [3, S, S]; Qwen [grid_t * grid_h * grid_w, C * T * P * P]
    num_tokens: int  # placeholder tokens in the prompt = rows of the encoder's output
    grid_thw: tuple[int, int, int] | None = None  # Qwen: the patch grid (temporal, height, width)


def _token(tokenizer_cfg: dict, key: str, default: str) -> str:
    """A named special token's string: top-level in hub files, under extra_special_tokens in others."""
    extra = tokenizer_cfg.get("extra_special_tokens")
    value = tokenizer_cfg.get(key) or (extra.get(key) if isinstance(extra, dict) else None) or default
    return value["content"] if isinstance(value, dict) else value


def expand_placeholders(prompt: str, placeholder: str, replacements: Sequence[str], field: str) -> str:
    """`prompt` with its i-th `placeholder` replaced by replacements[i] (the replacements may contain the
    placeholder again: they are not searched)."""
    pieces = prompt.split(placeholder)
    if len(pieces) - 1 != len(replacements):
        raise InvalidParameter(field, f"the prompt has {len(pieces) - 1} image placeholders ({placeholder!r}) "
                                      f"for {len(replacements)} images")
    out = [pieces[0]]
    for replacement, piece in zip(replacements, pieces[1:]):
        out += [replacement, piece]
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    """What both families share: the placeholder the chat template writes per image, the token that the
    encoder's outputs replace, and the checks on the tokenized prompt."""
    placeholder: str  # what the chat template renders for one image
    image_token: str  # the token each of an image's embeddings replaces
    image_token_id: int
    norm: Normalization

    def placeholder_ranges(self, token_ids: Sequence[int], images: Sequence[ProcessedImage],
                           field: str = "prompt") -> list[tuple[int, int]]:
        """(offset, length) of each image's run of image tokens in `token_ids`, in order; InvalidParameter
        unless the runs are exactly the images' token counts."""
        ids = np.asarray(token_ids)
        is_image = np.concatenate([[False], ids == self.image_token_id, [False]])
        edges = np.flatnonzero(is_image[1:] != is_image[:-1])
        runs = [(int(start), int(end - start)) for start, end in zip(edges[::2], edges[1::2])]
        if [length for _, length in runs] != [image.num_tokens for image in images]:
            raise InvalidParameter(field, f"the prompt's image tokens ({self.image_token!r}, runs of "
                                          f"{[n for _, n in runs]}) do not match its {len(images)} images "
                                          f"({[image.num_tokens for image in images]} tokens); is the image "
                                          f"token in the text, or was the prompt truncated?")
        return runs


@dataclasses.dataclass(frozen=True)
class Gemma3ImageProcessor(ImageProcessor):
    size: int = 896  # the vision tower's image_size: every image is resized to size x size
    resample: int = 2  # bilinear
    tokens_per_image: int = 256
    boi_token: str = "<start_of_image>"
    eoi_token: str = "<end_of_image>"

    def preprocess(self, image: Image.Image, field: str = "image") -> ProcessedImage:
        rgb = resize(to_rgb(image), self.size, self.size, self.resample)
        return ProcessedImage(rescale_normalize(rgb, self.norm), self.tokens_per_image)

    def expand_prompt(self, prompt: str, images: Sequence[ProcessedImage], field: str = "prompt") -> str:
        sequence = f"\n\n{self.boi_token}{self.image_token * self.tokens_per_image}{self.eoi_token}\n\n"
        return expand_placeholders(prompt, self.placeholder, [sequence] * len(images), field)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen-VL's target size: sides multiples of `factor`, close to the image's aspect ratio, with
    min_pixels <= height * width <= max_pixels. (Python's round: halves go to the even neighbour.)"""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio must be below 200, got {max(height, width) / min(height, width):.0f}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclasses.dataclass(frozen=True)
class QwenVLImageProcessor(ImageProcessor):
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # bicubic

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def preprocess(self, image: Image.Image, field: str = "image") -> ProcessedImage:
        try:
            height, width = self.target_size(image.height, image.width)
        except ValueError as e:
            raise InvalidParameter(field, f"{field}: {e}") from None
        x = rescale_normalize(resize(to_rgb(image), height, width, self.resample), self.norm)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        # [C, H, W] -> (block row, block col, row in block, col in block, C, patch row, patch col)
        patches = x.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        # A still image fills every temporal slot of the patch (the 3-D convolution sees t equal frames).
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
        flat = np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3 * t * p * p))
        return ProcessedImage(flat, grid_h * grid_w // (m * m), (1, grid_h, grid_w))

    def expand_prompt(self, prompt: str, images: Sequence[ProcessedImage], field: str = "prompt") -> str:
        return expand_placeholders(prompt, self.placeholder, [self.image_token * im.num_tokens for im in images],
                                   field)


def image_processor(model_dir: str | Path) -> Gemma3ImageProcessor | QwenVLImageProcessor:
    """The image processor a vision-language checkpoint's files describe; ValueError for other models."""
    config, images, processor, tokenizer_cfg = processor_files(model_dir)
    model_type = config.get("model_type")
    if model_type in GEMMA3_VISION_TYPES:
        if images.get("do_pan_and_scan"):
            raise ValueError(f"{model_dir}: Gemma 3's pan-and-scan crops (do_pan_and_scan) are not supported")
        size = images.get("size") or {}
        vision = config.get("vision_config") or {}
        boi = _token(tokenizer_cfg, "boi_token", "<start_of_image>")
        return Gemma3ImageProcessor(
            placeholder=boi, image_token=_token(tokenizer_cfg, "image_token", "<image_soft_token>"),
            image_token_id=int(config.get("image_token_index", config.get("image_token_id", 262_144))),
            norm=Normalization.from_config(images, IMAGENET_STANDARD, IMAGENET_STANDARD),
            size=int(size.get("height") or vision.get("image_size") or 896), resample=int(images.get("resample", 2)),
            tokens_per_image=int(processor.get("image_seq_length") or config.get("mm_tokens_per_image") or 256),
            boi_token=boi, eoi_token=_token(tokenizer_cfg, "eoi_token", "<end_of_image>"))
    if model_type in QWEN_VL_TYPES:
        min_pixels, max_pixels = qwen_pixel_limits(images)
        image_token = _token(tokenizer_cfg, "image_token", "<|image_pad|>")
        return QwenVLImageProcessor(
            placeholder=image_token, image_token=image_token,
            image_token_id=qwen_image_token_id(config),
            norm=Normalization.from_config(images, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
            min_pixels=min_pixels, max_pixels=max_pixels,
            patch_size=int(images.get("patch_size", 14)), temporal_patch_size=int(images.get("temporal_patch_size", 2)),
            merge_size=int(images.get("merge_size", 2)), resample=int(images.get("resample", 3)))
    raise ValueError(f"{model_dir}: model_type {model_type!r} takes no images "
                     f"(vision-language families: {', '.join(GEMMA3_VISION_TYPES + QWEN_VL_TYPES)})")
