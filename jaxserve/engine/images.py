"""A vision model's images in the engine: what is built at start, and the check of a request's images.

1. `images_for(args, built)` loads the vision encoder of a checkpoint whose images the engine runs (Gemma 3:
   SigLIP and its projector, `model/siglip.py`) as its own fixed-shape program (`execution/vision.py`),
   makes the encoder cache (`scheduling/encoder_cache.py`, `--mm-encoder-cache-gb`), sizes the step's encoder
   budget (`--max-num-encoder-input-tokens`; default the rows of `IMAGES_PER_STEP` images, within the token
   budget) and the encoder program's batch sizes from it, and hands out the two sides of it: the runner's
   `EncoderRowsBuilder` (it encodes what a step needs and places the rows, `execution/image_rows.py`) and the
   scheduler's `ImageScheduling` (references, budget, whole images: `scheduling/images.py`).
2. For any other model it gives `NoImages`, which refuses images by name: a text-only model, or a family
   whose images are not run yet (Qwen2.5-VL's language model, with M-RoPE, is not served yet).
3. Multi-host: process 0 (the leader, which schedules) alone loads the encoder, on a device of its own, and
   relays each step's rows to the others (`execution/relay.py`); they only place what arrives.
4. `attach(checked, images)` checks a request's images against the budget (an image must fit one step: its
   tokens attend to each other, so they are computed together) and attaches them as the scheduler's
   `ImageSpan`s, pixels included. Nothing is encoded before a step needs it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

import jax

from jaxserve.config_families import GEMMA3_VISION_TYPES
from jaxserve.errors import ImagesNotServed, InvalidParameter
from jaxserve.execution.image_rows import EncoderRowsBuilder
from jaxserve.execution.vision import VisionEncoderProgram
from jaxserve.json_files import read_json_object
from jaxserve.scheduling.encoder_cache import EncoderCache
from jaxserve.scheduling.images import ImageScheduling, ImageSpan
from jaxserve.scheduling.validation import CheckedRequest

logger = logging.getLogger(__name__)

IMAGES_PER_STEP = 4  # the default encoder budget of one step, in images (of rows: images x tokens per image)


def vision_model_type(model_dir: str | None) -> str | None:
    """The checkpoint's model_type when it is a vision-language one (its config has a vision_config)."""
    if not model_dir:
        return None
    cfg = read_json_object(Path(model_dir) / "config.json")
    return cfg.get("model_type") if cfg.get("vision_config") is not None else None


@dataclasses.dataclass(frozen=True)
class NoImages:
    """An engine that runs no vision encoder: every image is refused, naming its field."""
    model_name: str
    model_type: str | None  # a vision-language checkpoint's model_type whose images are not run; None: text only
    takes_images = False
    rows = None
    scheduling = None

    def attach(self, checked: CheckedRequest, images: Sequence) -> CheckedRequest:
        self.require(images)
        return checked

    def require(self, images: Sequence) -> None:
        """Refuse `images` (anything with a `field`), naming the first one's field."""
        if images:
            raise ImagesNotServed(images[0].field, images_refusal(self.model_name, self.model_type, images[0].field))


@dataclasses.dataclass(frozen=True)
class EngineImages:
    rows: EncoderRowsBuilder  # the runner's side
    scheduling: ImageScheduling  # the scheduler's side
    takes_images = True

    @property
    def cache(self) -> EncoderCache:
        return self.scheduling.cache

    def require(self, images: Sequence) -> None:
        """Every image may come (its size is checked once it is tokenized, by `attach`)."""

    def attach(self, checked: CheckedRequest, images: Sequence) -> CheckedRequest:
        """`checked` with its prompt's images (each with offset, length, content_hash, pixel_values and field,
        as `multimodal.prompt.PromptImage`); InvalidParameter naming the field of one that cannot be served."""
        spans = []
        for image in images:
            if image.length > self.scheduling.rows_per_step:
                raise InvalidParameter(image.field, f"{image.field}: the image takes {image.length} tokens, more than "
                                                    f"the {self.scheduling.rows_per_step} encoder rows one step "
                                                    f"places (raise max_num_batched_tokens)")
            if image.offset < 0 or image.offset + image.length > len(checked.prompt_ids):
                raise InvalidParameter(image.field, f"{image.field}: the image's tokens lie outside the prompt")
            spans.append(ImageSpan(image.offset, image.length, image.content_hash, image.pixel_values))
        return dataclasses.replace(checked, images=tuple(spans)) if spans else checked


def _runs_images(args, built) -> bool:
    return vision_model_type(args.model_dir) in GEMMA3_VISION_TYPES and built.runner == "generate"


def _vision_config(args):
    from jaxserve.vision_config import vision_config
    return vision_config(read_json_object(Path(args.model_dir) / "config.json", required=True))


def encoder_budget(args, step_tokens: int, tokens_per_image: int) -> int:
    """Encoder rows one step places: --max-num-encoder-input-tokens, checked against one image (computed whole
    in one step) and the step's token budget; by default `IMAGES_PER_STEP` images' within that budget (a budget
    under one image's tokens then refuses images at request time, naming the flag to raise)."""
    budget = args.max_num_encoder_input_tokens
    if budget is None:
        return min(step_tokens, IMAGES_PER_STEP * tokens_per_image)
    if not tokens_per_image <= budget <= step_tokens:
        raise ValueError(f"max_num_encoder_input_tokens {budget}: a step computes an image's {tokens_per_image} "
                         f"tokens whole, so it must be between {tokens_per_image} and max_num_batched_tokens "
                         f"({step_tokens})")
    return budget


def encoder_batch_sizes(images_per_step: int) -> tuple[int, ...]:
    """The encoder program's buckets: 1, 2, 4, ... images per call, up to what one step encodes at most."""
    sizes = [1 << k for k in range(max(images_per_step, 1).bit_length()) if 1 << k < images_per_step]
    return (*sizes, max(images_per_step, 1))


def _budget(args, built, config) -> int:
    return encoder_budget(args, built.scheduler_config.max_num_batched_tokens, config.mm_tokens_per_image)


def _rows(built, rows_per_step: int, cache=None, encoder=None) -> EncoderRowsBuilder:
    """The runner's side; Gemma 3's image tokens attend to each other (`spans`)."""
    return EncoderRowsBuilder(rows_per_step, built.model_config.hidden_size, built.dtype, built.model.plan.replicated,
                              cache, encoder, spans=True)


def images_for(args, built) -> EngineImages | NoImages:
    """The image side of the engine for `built` (a `BuiltModel`) under `args`."""
    model_type = vision_model_type(args.model_dir)
    if not _runs_images(args, built):
        return NoImages(built.name, model_type)
    config = _vision_config(args)
    budget = _budget(args, built, config)
    cache = EncoderCache(int(args.mm_encoder_cache_gb * (1 << 30)))
    if jax.process_index() == 0:
        rows = _rows(built, budget, cache, _encoder(args, built, config, budget))
        logger.info("vision encoder: %d tokens per image, at most %d encoder rows per step, one program for each "
                    "of %s images per call, whole on %s (not tensor-parallel; its rows go to the step replicated%s); "
                    "encoder cache: %.3g GiB of rows kept for images no request needs", config.mm_tokens_per_image,
                    rows.rows_per_step, "/".join(map(str, rows.encoder.buckets)), rows.encoder.device,
                    ", relayed to the other processes" if jax.process_count() > 1 else "", args.mm_encoder_cache_gb)
    else:  # a multi-host follower: the leader encodes, and relays each step's rows
        rows = _rows(built, budget)
        logger.info("vision encoder: on process 0, which relays the rows of each step's images")
    # A chunk holds an image whole, since its tokens attend to each other.
    return EngineImages(rows, ImageScheduling(cache, rows.rows_per_step, whole_images=True))


def _encoder(args, built, config, budget: int) -> VisionEncoderProgram:
    from jaxserve.loader.encoders import load_vision_encoder

    # The first of the mesh's devices that this process drives (a multi-host mesh's first may be another's).
    device = next(d for d in built.model.plan.mesh.devices.flat if d.process_index == jax.process_index())
    return VisionEncoderProgram(load_vision_encoder(args.model_dir, built.dtype),
                                (config.num_channels, config.image_size, config.image_size), built.dtype, device=device,
                                buckets=encoder_batch_sizes(budget // config.mm_tokens_per_image))


def abstract_rows(args, built) -> EncoderRowsBuilder | None:
    """The steps' image input as shapes only (`jaxserve plan`: no encoder, no cache); None: no images."""
    if not _runs_images(args, built):
        return None
    return _rows(built, _budget(args, built, _vision_config(args)))


def images_refusal(model_name: str, model_type: str | None, field: str) -> str:
    """Why this engine takes no images for `model_name`."""
    if model_type is not None:
        return (f"{field}: model `{model_name}` ({model_type}) takes images in its checkpoint, but jaxserve does not "
                f"serve them for this family yet: images run on Gemma 3 checkpoints (Qwen2.5-VL's language model "
                f"with its multimodal rotary positions is not served yet); send text only")
    return f"{field}: model `{model_name}` takes no images: it is a text-only model"
