"""`GET /v1/models` and vLLM's `GET /version`: what this server serves.

The model list holds the base model and, with --enable-lora, every loaded adapter under its name, its
`parent` the base model, so a client may name either as a request's `model`.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve import __version__
from server.http.errors import APIError, error_response
from server.serving.context import ServingContext


async def models_route(ctx: ServingContext, request: Request) -> Response:
    try:
        ctx.require_ready()
    except APIError as e:
        return error_response(e)
    model = ctx.model
    adapters = model.lora.names() if model.lora is not None else []
    modalities = ["text", "image"] if model.takes_images else ["text"]
    return JSONResponse({"object": "list", "data": [
        model_card(model.name, ctx.created, model.root, model.max_model_len, input_modalities=modalities),
        *(model_card(r.lora_name, ctx.created, r.lora_path, model.max_model_len, parent=model.name,
                     input_modalities=modalities) for r in adapters)]})


async def version_route(request: Request) -> Response:
    return JSONResponse({"version": __version__})


def model_card(name: str, created: int, root: str, max_model_len: int, parent: str | None = None,
               input_modalities: list[str] | None = None) -> dict:
    """One `/v1/models` entry in vLLM's shape: OpenAI's fields, then `root` (where the weights came from),
    `parent` (null for the base model; a LoRA adapter's base), `max_model_len` and one `permission` object;
    jaxserve adds `input_modalities` (["text"], or ["text", "image"] for a vision-language checkpoint; the
    playground shows its image control by it)."""
    permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                  "organization": "*", "group": None, "is_blocking": False}
    return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": [permission],
            "input_modalities": input_modalities or ["text"]}
