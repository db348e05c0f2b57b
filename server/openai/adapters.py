"""vLLM's runtime LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

1. Both sit behind the API key like every route but /health, and answer only when the server was started
   with `--allow-runtime-lora-updating` (or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`); otherwise a
   404 that says how to turn them on, as they would not exist in vLLM.
2. Loading reads and checks the adapter off the event loop (`LoRAManager.register`): a bad folder, DoRA,
   modules_to_save or a rank above `--max-lora-rank` is a 400 naming the file and the reason, and a taken
   name is a 400. The adapter then appears in /v1/models and requests may name it as their `model`.
3. Unloading removes the name at once: new requests for it get a 404, while requests already queued or
   running under it finish with it (its device slot is reused once they are done). An unknown name is a 404.
The replies are vLLM's plain-text success lines.
"""

from __future__ import annotations

import json

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from server.http.errors import APIError, error_response


def lora_routes(api) -> list[Route]:
    async def load(request: Request) -> Response:
        try:
            manager, body = await _checked(api, request, ("lora_name", "lora_path"))
            try:
                await run_in_threadpool(manager.register, body["lora_name"], body["lora_path"])
            except ValueError as e:  # LoRAError (the adapter) or a taken name
                raise APIError(400, str(e), param="lora_path" if "already" not in str(e) else "lora_name",
                               code="invalid_lora_adapter") from None
        except APIError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(request: Request) -> Response:
        try:
            manager, body = await _checked(api, request, ("lora_name",))
            try:
                manager.unregister(body["lora_name"])
            except KeyError:
                raise APIError(404, f"The lora adapter '{body['lora_name']}' cannot be found.", param="lora_name",
                               code="lora_adapter_not_found") from None
        except APIError as e:
            return error_response(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]


async def _checked(api, request: Request, fields: tuple[str, ...]):
    if not api.options.allow_runtime_lora_updating:
        raise APIError(404, f"{request.url.path} is off: start the server with --allow-runtime-lora-updating "
                            "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) to load and unload LoRA adapters at run time",
                       code="not_found")
    api.require_ready()
    manager = api.engine.lora
    if manager is None:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)")
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    for field in fields:
        if not isinstance(body.get(field), str) or not body[field]:
            raise APIError(400, f"{field} must be a non-empty string", param=field)
    if body["lora_name"] == api.engine.model_name:
        raise APIError(400, f"lora_name {body['lora_name']!r} is the base model's name", param="lora_name")
    return manager, body
