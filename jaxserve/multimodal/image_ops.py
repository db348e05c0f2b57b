"""The pixel operations Hugging Face image processors apply, in PIL and numpy, as their PIL backend does.

Each step reproduces transformers' `PilBackend` to the bit, so that an image becomes the same floats here
as in the reference implementation (the encoder tests compare against them at 1e-4 and less):
1. `to_rgb`: RGB uint8; an image with transparency is composited onto white first (a transparent PNG
   turns white, not black), palette and grey images are expanded.
2. `resize`: PIL's resampling filters on the uint8 RGB image, to (height, width).
3. `rescale_normalize`: `pixels * rescale_factor` computed in float64 then rounded to float32, then
   `(x - mean) / std` in float32, channel-first [3, H, W].
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image

# PIL's filter numbers, as preprocessor_config.json writes `resample`.
RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
            3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclasses.dataclass(frozen=True)
class Normalization:
    """The rescale and normalize steps of a processor (`preprocessor_config.json`)."""
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_config(cls, cfg: dict, default_mean, default_std) -> "Normalization":
        return cls(rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                   mean=tuple(cfg.get("image_mean") or default_mean), std=tuple(cfg.get("image_std") or default_std),
                   do_rescale=cfg.get("do_rescale", True) is not False,
                   do_normalize=cfg.get("do_normalize", True) is not False)


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB image; transparency composited onto a white background (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image.resize((width, height), resample=RESAMPLE[resample])


def rescale_normalize(image: Image.Image, norm: Normalization) -> np.ndarray:
    """RGB image -> float32 [3, H, W], rescaled and normalized as the processor does."""
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    x = (pixels.astype(np.float64) * norm.rescale_factor).astype(np.float32) if norm.do_rescale \
        else pixels.astype(np.float32)
    if norm.do_normalize:
        mean = np.asarray(norm.mean, np.float32)[:, None, None]
        std = np.asarray(norm.std, np.float32)[:, None, None]
        x = (x - mean) / std
    return x
