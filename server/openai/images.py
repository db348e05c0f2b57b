"""Images in chat requests, up to the engine (the chat completions and Responses routes).

1. `template_messages` (server/openai/prompts.py) has found the image parts; `check` refuses too many
   images (--limit-mm-per-prompt) and images for a text-only model before anything is fetched, and so does
   an engine that runs no vision encoder for the model (Qwen2-VL; a multi-host mesh; a pooling runner).
2. On worker threads (fetching and decoding block): each image is loaded under the server's media policy
   (--allowed-local-media-path, --allowed-media-domains, the fetch timeout and byte limit; a refused
   scheme, path or address, a timeout, an oversized or undecodable image, a decompression bomb), the chat
   template renders `{"type": "image"}` placeholders, and the checkpoint's processor preprocesses the
   images and expands the placeholders into the prompt's token ids: one `MultiModalPrompt`.
3. The handler hands the prompt's token ids to the engine's check and attaches its images
   (`EngineClient.attach_images`, `engine/images.py`): the engine encodes them and places their rows at the
   image tokens. Every refusal is a 400 naming the field (`messages.0.content.1.image_url.url`), and
   nothing was allocated.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from jaxserve.errors import InvalidMedia, InvalidParameter
from jaxserve.multimodal.chat_parts import ImageSource
from jaxserve.errors import ImagesNotServed
from jaxserve.multimodal.prompt import MultiModalPrompt
from server.http.errors import APIError
from server.openai.prompts import render_chat
from server.openai.protocol import ChatCompletionRequest
from server.serving.context import ServingContext


async def image_prompt(ctx: ServingContext, body: ChatCompletionRequest, messages: list[dict],
                       images: list[ImageSource]) -> MultiModalPrompt:
    """The request's prompt with its images, ready for the engine. APIError."""
    inputs = ctx.model.image_inputs
    tokenizer = ctx.model.tokenizer
    try:
        inputs.check(images)
        ctx.engine.require_images(images)
        loaded = await run_in_threadpool(inputs.load, images)
        text = await run_in_threadpool(render_chat, ctx, body, messages)
        prompt = await run_in_threadpool(inputs.prompt, text, loaded, images,
                                         lambda t: tokenizer.encode(t, body.add_special_tokens))
        return prompt
    except InvalidParameter as e:
        code = "unsupported_parameter" if isinstance(e, ImagesNotServed) else \
            "invalid_image" if isinstance(e, InvalidMedia) else None
        raise APIError(400, str(e), param=e.param, code=code) from None
