"""A vision-language checkpoint's processor settings, read without decoding anything (no PIL): what the
request side's processors (`processors.py`) and the engine's sizing of its encoder programs both need.

1. `processor_files(model_dir)` reads config.json, the image processor's settings (`preprocessor_config.json`,
   or the `image_processor` part of `processor_config.json` as transformers 5 saves it), processor_config.json
   and tokenizer_config.json.
2. `qwen_pixel_limits(settings)` is Qwen-VL's (min_pixels, max_pixels): every image is resized to lie
   between them, so they bound the patches the vision encoder ever takes. `qwen_image_token_id(config)` is
   the token its image placeholders expand to, which the M-RoPE positions look for too.
"""

from __future__ import annotations

from pathlib import Path

from jaxserve.json_files import read_json_object


def processor_files(model_dir: str | Path) -> tuple[dict, dict, dict, dict]:
    """(config.json, image processor settings, processor_config.json, tokenizer_config.json) of a checkpoint;
    transformers 5 may keep the image processor's settings inside processor_config.json."""
    model_dir = Path(model_dir)
    config = read_json_object(model_dir / "config.json", required=True)
    processor = read_json_object(model_dir / "processor_config.json")
    images = read_json_object(model_dir / "preprocessor_config.json") or dict(processor.get("image_processor") or {})
    return config, images, processor, read_json_object(model_dir / "tokenizer_config.json")


def qwen_pixel_limits(images: dict) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen-VL image processor's settings (either spelling; transformers'
    defaults)."""
    size = images.get("size") or {}
    return (int(images.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            int(images.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))


def qwen_image_token_id(config: dict) -> int:
    """The id of Qwen-VL's image token (`<|image_pad|>`) from a checkpoint's config.json (transformers' default)."""
    return int(config.get("image_token_id", 151_655))
