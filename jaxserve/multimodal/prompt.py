"""A request's images and prompt text -> one `MultiModalPrompt`: what the engine takes for a vision request.

1. `ImageInputs.for_model(model_dir, ...)` is built once per served model: the checkpoint's image processor
   (None for a text-only model), the media policy (the server's media flags) and the per-prompt limit.
2. `check(sources)` runs before anything is fetched: at most `limit` images (--limit-mm-per-prompt), and
   none for a model without a vision tower, each refusal an InvalidParameter naming the field.
3. `load(sources)` fetches and decodes each image with the policy's guards (`media.py`; blocking: the
   server calls it on a worker thread).
4. `prompt(text, images, sources, encode)` preprocesses each image as the checkpoint's processor does,
   expands the rendered prompt's placeholders to the images' token runs, tokenizes it and finds each run:
   per image its pixels, grid, content hash and token span (`placeholder_ranges`).
5. The engine takes the prompt's token ids and its images (`Engine.check_request`): it runs the vision
   encoder where it serves the family's images (Gemma 3, Qwen2.5-VL) and refuses them by name elsewhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

from jaxserve.config_families import GEMMA3_VISION_TYPES, QWEN_VL_TYPES
from jaxserve.errors import ImagesNotServed, InvalidParameter
from jaxserve.json_files import read_json_object
from jaxserve.multimodal.chat_parts import ImageSource
from jaxserve.multimodal.media import MediaPolicy, image_hash, load_image
from jaxserve.multimodal.processors import image_processor

VISION_TYPES = GEMMA3_VISION_TYPES + QWEN_VL_TYPES


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt, ready for the vision encoder, and where its embeddings go."""
    content_hash: str  # sha256 of the decoded pixels: the encoder cache's and the prefix cache's key
    pixel_values: np.ndarray  # float32: Gemma 3 [3, S, S]; Qwen [patches, C * T * P * P]
    grid_thw: tuple[int, int, int] | None  # Qwen's patch grid; None for fixed-size encoders
    offset: int  # index of the image's first placeholder token in token_ids
    length: int  # its placeholder tokens (= rows of the encoder's output)
    field: str  # the request field that carried it


@dataclasses.dataclass(frozen=True, eq=False)
class MultiModalPrompt:
    """A prompt with images: token ids with each image's placeholder tokens expanded, and the images."""
    text: str  # the prompt after expansion (what was tokenized)
    token_ids: list[int]
    images: tuple[PromptImage, ...]
    image_token_id: int

    @property
    def first_field(self) -> str:
        return self.images[0].field if self.images else "prompt"


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """The request side of image input for one model."""
    model_name: str
    processor: object | None  # Gemma3ImageProcessor / QwenVLImageProcessor; None: the model takes no images
    policy: MediaPolicy
    limit: int  # images per prompt

    @classmethod
    def for_model(cls, model_dir: str | None, model_name: str, policy: MediaPolicy, limit: int) -> ImageInputs:
        config = read_json_object(Path(model_dir) / "config.json") if model_dir else {}
        takes_images = config.get("model_type") in VISION_TYPES
        return cls(model_name, image_processor(model_dir) if takes_images else None, policy, limit)

    @classmethod
    def from_args(cls, args, model_name: str) -> ImageInputs:
        """From an `EngineArgs` (its media fields: the flags vLLM names so)."""
        policy = MediaPolicy(allowed_local_path=args.allowed_local_media_path,
                             allowed_domains=args.allowed_media_domains, fetch_timeout_s=args.media_fetch_timeout,
                             max_bytes=args.max_media_bytes)
        return cls.for_model(args.model_dir, model_name, policy, args.image_limit)

    @property
    def takes_images(self) -> bool:
        return self.processor is not None

    def check(self, sources: Sequence[ImageSource]) -> None:
        """Refuse, before fetching anything, more images than the limit and images for a text-only model."""
        if len(sources) > self.limit:
            raise InvalidParameter(sources[self.limit].field,
                                   f"{sources[self.limit].field}: at most {self.limit} image(s) may be given in one "
                                   f"prompt, this one has {len(sources)} (the server's --limit-mm-per-prompt)")
        if sources and not self.takes_images:
            raise ImagesNotServed(sources[0].field,
                                  f"{sources[0].field}: model `{self.model_name}` takes no images: it is a text-only "
                                  f"model (image input is for vision-language checkpoints: "
                                  f"{', '.join(VISION_TYPES)})")

    def load(self, sources: Sequence[ImageSource]) -> list[Image.Image]:
        """Each image fetched and decoded under the media policy (blocking)."""
        return [load_image(s.source, self.policy, s.field) for s in sources]

    def prompt(self, text: str, images: Sequence[Image.Image], sources: Sequence[ImageSource],
               encode: Callable[[str], list[int]], field: str = "messages") -> MultiModalPrompt:
        """The rendered prompt `text` (one placeholder per image, as the chat template writes them) with the
        images preprocessed, the placeholders expanded and tokenized by `encode`."""
        processed = [self.processor.preprocess(image, s.field) for image, s in zip(images, sources)]
        expanded = self.processor.expand_prompt(text, processed, field)
        token_ids = encode(expanded)
        spans = self.processor.placeholder_ranges(token_ids, processed, field)
        return MultiModalPrompt(expanded, token_ids, tuple(
            PromptImage(image_hash(image), p.pixel_values, p.grid_thw, offset, length, s.field)
            for image, p, s, (offset, length) in zip(images, processed, sources, spans)),
            self.processor.image_token_id)
