"""A vision model's images in the engine: what is built at start, and the check of a request's images.

1. `images_for(args, built)` loads the vision encoder of a checkpoint whose images the engine runs as its own
   fixed-shape program: Gemma 3's SigLIP and projector (`model/siglip.py`, `execution/vision.py`: buckets of
   images) or Qwen2.5-VL's ViT (`model/qwen_vit.py`, `execution/vision_patches.py`: buckets of patches, with
   the M-RoPE side in `qwen_images.py`); makes the encoder cache (`scheduling/encoder_cache.py`,
   `--mm-encoder-cache-gb`), sizes the step's encoder budget (`--max-num-encoder-input-tokens`; default the
   rows of `IMAGES_PER_STEP` of the largest images, within the token budget) and hands out the two sides of
   it: the runner's `EncoderRowsBuilder` (it encodes what a step needs and places the rows,
   `execution/image_rows.py`) and the scheduler's `ImageScheduling` (references, budget, whole images:
   `scheduling/images.py`).
2. For any other model it gives `NoImages`, which refuses images by name: a text-only model, or a family
   whose images are not run (Qwen2-VL, whose ViT differs from 2.5's; a pooling runner; Qwen2.5-VL on a
   multi-host mesh).
3. Multi-host (Gemma 3): process 0 (the leader, which schedules) alone loads the encoder, on a device of its
   own, and relays each step's rows to the others (`execution/relay.py`); they only place what arrives.
4. `attach(checked, images)` checks a request's images and attaches them as the scheduler's `ImageSpan`s,
   pixels included: Gemma 3's must each fit one step (its tokens attend to each other, so they are computed
   together), Qwen's within the encoder's largest program, and a Qwen prompt gets its M-RoPE positions.
   Nothing is encoded before a step needs it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Sequence

import jax

from jaxserve.config_families import GEMMA3_VISION_TYPES, QWEN_VL_TYPES
from jaxserve.engine.qwen_images import MRoPEImages, encoder_buckets, max_image_tokens, patch_encoder
from jaxserve.errors import ImagesNotServed, InvalidParameter
from jaxserve.execution.image_rows import EncoderRowsBuilder
from jaxserve.execution.vision import VisionEncoderProgram
from jaxserve.json_files import read_json_object
from jaxserve.scheduling.encoder_cache import EncoderCache
from jaxserve.scheduling.images import ImageScheduling, ImageSpan
from jaxserve.scheduling.validation import CheckedRequest
from jaxserve.vision_config import QwenVisionConfig

logger = logging.getLogger(__name__)

IMAGES_PER_STEP = 4  # the default encoder budget of one step, in images (of rows: images x tokens per image)
SERVED_VISION_TYPES = GEMMA3_VISION_TYPES + ("qwen2_5_vl",)  # whose encoders run (Qwen2-VL's ViT is not built)


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
    mrope: MRoPEImages | None = None  # Qwen2.5-VL: images by patches, and each prompt's M-RoPE positions
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
            if self.scheduling.whole_images and image.length > self.scheduling.rows_per_step:
                raise InvalidParameter(image.field, f"{image.field}: the image takes {image.length} tokens, more than "
                                                    f"the {self.scheduling.rows_per_step} encoder rows one step "
                                                    f"places (raise max_num_batched_tokens)")
            if image.offset < 0 or image.offset + image.length > len(checked.prompt_ids):
                raise InvalidParameter(image.field, f"{image.field}: the image's tokens lie outside the prompt")
            pixels = image.pixel_values if self.mrope is None else self.mrope.pixels(image)
            spans.append(ImageSpan(image.offset, image.length, image.content_hash, pixels))
        if not spans:
            return checked
        mrope = None if self.mrope is None else self.mrope.positions(checked.prompt_ids, images)
        return dataclasses.replace(checked, images=tuple(spans), mrope=mrope)


def _runs_images(args, built) -> bool:
    return vision_model_type(args.model_dir) in SERVED_VISION_TYPES and built.runner == "generate"


def _vision_config(args):
    from jaxserve.vision_config import vision_config
    return vision_config(read_json_object(Path(args.model_dir) / "config.json", required=True))


def encoder_budget(args, step_tokens: int, tokens_per_image: int, whole_images: bool = True) -> int:
    """Encoder rows one step places: --max-num-encoder-input-tokens, checked against one image where images are
    computed whole in one step (Gemma 3) and against the step's token budget; by default `IMAGES_PER_STEP`
    images' (the largest, `tokens_per_image`) within that budget (a budget under one image's tokens then
    refuses such images at request time, naming the flag to raise)."""
    budget = args.max_num_encoder_input_tokens
    if budget is None:
        return min(step_tokens, IMAGES_PER_STEP * tokens_per_image)
    least = tokens_per_image if whole_images else 1
    if not least <= budget <= step_tokens:
        why = f"a step computes an image's {least} tokens whole, so " if whole_images else ""
        raise ValueError(f"max_num_encoder_input_tokens {budget}: {why}it must be between {least} and "
                         f"max_num_batched_tokens ({step_tokens})")
    return budget


def encoder_batch_sizes(images_per_step: int) -> tuple[int, ...]:
    """The encoder program's buckets: 1, 2, 4, ... images per call, up to what one step encodes at most."""
    sizes = [1 << k for k in range(max(images_per_step, 1).bit_length()) if 1 << k < images_per_step]
    return (*sizes, max(images_per_step, 1))


def _rows(built, rows_per_step: int, cache=None, encoder=None, spans: bool = True) -> EncoderRowsBuilder:
    """The runner's side; `spans`: an image's tokens attend to each other (Gemma 3; Qwen's are causal)."""
    return EncoderRowsBuilder(rows_per_step, built.model_config.hidden_size, built.dtype, built.model.plan.replicated,
                              cache, encoder, spans=spans)


def images_for(args, built) -> EngineImages | NoImages:
    """The image side of the engine for `built` (a `BuiltModel`) under `args`."""
    model_type = vision_model_type(args.model_dir)
    if not _runs_images(args, built):
        return NoImages(built.name, model_type)
    config = _vision_config(args)
    if model_type in QWEN_VL_TYPES:
        return _qwen_images(args, built, config, model_type)
    budget = encoder_budget(args, built.scheduler_config.max_num_batched_tokens, config.mm_tokens_per_image)
    cache = EncoderCache(_cache_bytes(args))
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


def _cache_bytes(args) -> int:
    return int(args.mm_encoder_cache_gb * (1 << 30))


def _local_device(built):
    """The first of the mesh's devices that this process drives (a multi-host mesh's first may be another's)."""
    return next(d for d in built.model.plan.mesh.devices.flat if d.process_index == jax.process_index())


def _encoder(args, built, config, budget: int) -> VisionEncoderProgram:
    from jaxserve.loader.encoders import load_vision_encoder

    return VisionEncoderProgram(load_vision_encoder(args.model_dir, built.dtype),
                                (config.num_channels, config.image_size, config.image_size), built.dtype,
                                device=_local_device(built),
                                buckets=encoder_batch_sizes(budget // config.mm_tokens_per_image))


def _qwen_images(args, built, config, model_type: str) -> EngineImages | NoImages:
    """Qwen2.5-VL: the ViT by buckets of patches, causal image tokens (a chunk may cut through an image), and
    each prompt's M-RoPE positions (`qwen_images.py`). One host only: the relay of its steps is not tested."""
    if jax.process_count() > 1:
        logger.warning("Qwen2.5-VL images are not served on a multi-host mesh: the vision encoder is not loaded")
        return NoImages(built.name, model_type)
    from jaxserve.loader.encoders import load_vision_encoder

    encoder = load_vision_encoder(args.model_dir, built.dtype)
    program = patch_encoder(args.model_dir, config, encoder, built.dtype, _local_device(built))
    budget = encoder_budget(args, built.scheduler_config.max_num_batched_tokens, max_image_tokens(program),
                            whole_images=False)
    rows = _rows(built, budget, EncoderCache(_cache_bytes(args)), program, spans=False)
    logger.info("vision encoder: images of up to %d patches (%d tokens), at most %d encoder rows per step, one "
                "program for each of %s patches per call, whole on %s (not tensor-parallel; its rows go to the "
                "step replicated); encoder cache: %.3g GiB of rows kept for images no request needs",
                program.max_patches, max_image_tokens(program), rows.rows_per_step,
                "/".join(map(str, program.buckets)), program.device, args.mm_encoder_cache_gb)
    return EngineImages(rows, ImageScheduling(rows.cache, rows.rows_per_step, whole_images=False),
                        MRoPEImages.for_model(args.model_dir, program))


def abstract_rows(args, built) -> EncoderRowsBuilder | None:
    """The steps' image input as shapes only (`jaxserve plan`: no encoder, no cache); None: no images."""
    if not _runs_images(args, built):
        return None
    config = _vision_config(args)
    step_tokens = built.scheduler_config.max_num_batched_tokens
    if isinstance(config, QwenVisionConfig):
        tokens = encoder_buckets(args.model_dir, config)[-1] // config.merge_unit
        return _rows(built, encoder_budget(args, step_tokens, tokens, whole_images=False), spans=False)
    return _rows(built, encoder_budget(args, step_tokens, config.mm_tokens_per_image))


def images_refusal(model_name: str, model_type: str | None, field: str) -> str:
    """Why this engine takes no images for `model_name`."""
    if model_type is not None:
        return (f"{field}: model `{model_name}` ({model_type}) takes images in its checkpoint, but this engine does "
                f"not run its vision encoder: images run on Gemma 3 and Qwen2.5-VL checkpoints served by the "
                f"generate runner on one host (Qwen2-VL's encoder is not built); send text only")
    return f"{field}: model `{model_name}` takes no images: it is a text-only model"
