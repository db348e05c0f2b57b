"""Image parts of chat messages, in the shapes clients send them, turned into what chat templates render.

1. A message's content may be a list of parts in OpenAI's shape: `{"type": "text", "text": ...}` and
   `{"type": "image_url", "image_url": {"url": ...}}` (chat completions), `{"type": "input_image",
   "image_url": ...}` (the Responses API, whose image_url is the URL itself), or, from the offline API,
   `{"type": "image", "image": <PIL image or URL>}` / `{"type": "image_pil", "image_pil": <PIL image>}`;
   several images per message, interleaved with text.
2. `split_images(messages)` hands each image part to the chat template as `{"type": "image"}` (the one
   image shape every vision model's template knows: Gemma 3's knows no other, as vLLM does it) and
   collects the images' sources in order, each with the request field that carried it, so a bad image is
   refused by name (`messages.0.content.1.image_url.url`). Messages without images pass unchanged.
This module only reshapes dicts: loading the images is `media.py`'s job, the prompt `prompt.py`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.errors import InvalidMedia

IMAGE_PART_TYPES = ("image_url", "input_image", "image", "image_pil")
TEMPLATE_IMAGE_PART = {"type": "image"}


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """Where one image of a request comes from."""
    source: Any  # a URL (data:, file://, http(s)://) or, offline, a PIL image
    field: str  # the request field that carried it, for errors


def image_source(part: dict, field: str) -> ImageSource:
    """The image one content part names; InvalidMedia naming the field when it names none."""
    kind = part.get("type")
    value = part.get(kind) if kind in ("image", "image_pil") else part.get("image_url")
    if kind == "image_url" and isinstance(value, dict):  # chat completions: {"url": ..., "detail": ...}
        value, field = value.get("url"), f"{field}.image_url.url"
    else:
        field = f"{field}.{'image_url' if kind in ('image_url', 'input_image') else kind}"
    if value is None or (isinstance(value, str) and not value):
        raise InvalidMedia(field, f"{field}: an image part needs its image (a URL such as data:image/png;base64,...)")
    return ImageSource(value, field)


def split_images(messages: list[dict], field: str = "messages") -> tuple[list[dict], list[ImageSource]]:
    """(messages as the chat template takes them, the images' sources in prompt order)."""
    rendered, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(part) for part in content):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                sources.append(image_source(part, f"{field}.{i}.content.{j}"))
                parts.append(dict(TEMPLATE_IMAGE_PART))
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, sources


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
