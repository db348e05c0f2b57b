"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

1. Both sit behind the API key like every route but /health, and answer only when the server was started
   with `--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`); otherwise a
   404 that says how to turn them on, as they would not exist in vLLM.
2. Loading reads and checks the adapter off the event loop (`LoRAManager.register`): a bad folder, DoRA,
   modules_to_save or a rank above `--max-lora-rank` is a 400 naming the file and the reason, and a taken
   name is a 400. The adapter then appears in /v1/models and requests may name it as their `model`.
3. Unloading removes the name at once: new requests for it get a 404, while requests already queued or
   running under it finish with it (its device slot is reused once they are done). An unknown name is a 404.
The bodies are read like every other (server/http/bodies.py); the replies are vLLM's plain-text success
lines.
"""

from __future__ import annotations

from pydantic import Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jaxserve.lora.manager import LoRAManager
from server.http.bodies import RequestBody, read_body
from server.http.errors import APIError, error_response
from server.serving.context import ServingContext


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name alone says which adapter


def lora_routes(ctx: ServingContext) -> list[Route]:
    async def load(request: Request) -> Response:
        try:
            manager, body = await _checked(ctx, request, LoadLoRAAdapterRequest)
            try:
                await run_in_threadpool(manager.register, body.lora_name, body.lora_path)
            except ValueError as e:  # LoRAError (the adapter) or a taken name
                raise APIError(400, str(e), param="lora_path" if "already" not in str(e) else "lora_name",
                               code="invalid_lora_adapter") from None
        except APIError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        try:
            manager, body = await _checked(ctx, request, UnloadLoRAAdapterRequest)
            try:
                manager.unregister(body.lora_name)
            except KeyError:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                               code="lora_adapter_not_found") from None
        except APIError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]


async def _checked(ctx: ServingContext, request: Request, schema: type[RequestBody]) -> tuple[LoRAManager, RequestBody]:
    if not ctx.options.allow_runtime_lora_updating:
        raise APIError(404, f"{request.url.path} is off: start the server with --allow-runtime-lora-updating "
                            "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) to load and unload LoRA adapters at run time",
                       code="not_found")
    ctx.require_ready()
    manager = ctx.model.lora
    if manager is None:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    body = await read_body(request, schema)
    if body.lora_name == ctx.model.name:
        raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", param="lora_name")
    return manager, body
