"""A prompt's images as the scheduler sees them: token spans with a content hash, nothing else.

1. `ImageSpan`: where an image's placeholder tokens sit in the prompt (`offset`, `length`) and the hash of
   its pixels, which names its encoder rows (`encoder_cache.py`) and its pages in the prefix cache.
2. `fit_chunk` bounds a prefill chunk by the images in it: their encoder rows must fit the step's encoder
   budget, and for a model that attends bidirectionally among one image's tokens (Gemma 3) a chunk may not
   end inside an image (every token of the image must be in the step that computes its last one; the rest
   of the image is earlier in the cache or in the same step). A causal-only model may cut through.
3. `image_chunks` lists, for a planned span, each image's part in it (`ImageChunk`: which rows of the
   image, where in the span, where the image ends), the plain data the batch builder places.
4. `page_extras` folds the hashes of the images a page covers into that page's prefix-cache key: two
   prompts with the same text and different images never share pages; a repeated image hits.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class ImageSpan:
    offset: int  # position of the image's first placeholder token
    length: int  # its placeholder tokens (= the encoder's rows for it)
    content_hash: str
    pixels: object = dataclasses.field(default=None, compare=False, repr=False)  # the encoder's input, until encoded

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclasses.dataclass(frozen=True, slots=True)
class ImageChunk:
    """An image's tokens in one planned span."""
    content_hash: str
    first_row: int  # the image's encoder row of the chunk's first token
    token: int  # that token's index in the span
    count: int  # tokens of the image in the span
    last_position: int  # position of the image's last token: its tokens attend up to there


def _overlaps(images: Sequence[ImageSpan], lo: int, hi: int):
    for image in images:
        if image.offset < hi and image.end > lo:
            yield image


def fit_chunk(images: Sequence[ImageSpan], start: int, n: int, rows_left: int, whole_images: bool) -> int:
    """The longest chunk of at most `n` tokens from `start` whose image tokens fit `rows_left` encoder rows
    and, with `whole_images`, that does not end inside an image (0: none fits in this step)."""
    used = 0
    for image in _overlaps(images, start, start + n):
        lo, hi = max(image.offset, start), min(image.end, start + n)
        if used + hi - lo > rows_left:
            n = lo - start + (rows_left - used)
            break
        used += hi - lo
    if whole_images:
        for image in _overlaps(images, start, start + n):
            if start + n < image.end:
                return max(image.offset - start, 0)
    return n


def image_chunks(images: Sequence[ImageSpan], start: int, n: int) -> tuple[ImageChunk, ...]:
    chunks = []
    for image in _overlaps(images, start, start + n):
        lo, hi = max(image.offset, start), min(image.end, start + n)
        chunks.append(ImageChunk(image.content_hash, lo - image.offset, lo - start, hi - lo, image.end - 1))
    return tuple(chunks)


def page_extras(images: Sequence[ImageSpan], page_size: int) -> Callable[[int], tuple] | None:
    """Page index -> the extra prefix-cache keys of that page: the hashes of the images it covers, each with
    the image's first position, so the key says which image sits where (None for a prompt without images)."""
    if not images:
        return None

    def extras(page: int) -> tuple:
        lo = page * page_size
        return tuple(x for image in _overlaps(images, lo, lo + page_size) for x in ("image", image.content_hash,
                                                                                        image.offset))
    return extras


@dataclasses.dataclass
class ImageScheduling:
    """What the scheduler keeps for a vision model's images: their encoder rows' references, the step's
    encoder budget in rows, and whether a chunk must hold an image whole."""
    cache: object  # `encoder_cache.EncoderCache`
    rows_per_step: int
    whole_images: bool

    def acquire(self, request) -> None:
        """A new request and its choices need their images' rows until each finishes. The cache keeps the
        pixels until it has the rows, and a referenced entry is never evicted: the requests drop theirs."""
        light = tuple(dataclasses.replace(image, pixels=None) for image in request.images)
        for choice in (request, *request.forks):
            self.cache.acquire(choice.key, request.images)
            choice.images = light

    def release(self, request) -> None:
        self.cache.release(request.key, (image.content_hash for image in request.images))

    def fit(self, request, n: int, rows_left: int) -> int:
        return fit_chunk(request.images, request.num_computed, n, rows_left, self.whole_images)
