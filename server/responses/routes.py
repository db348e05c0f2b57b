"""`POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`: OpenAI's Responses API,
run by the chat route's code.

1. Parse the body (server/responses/protocol.py), take the conversation of `previous_response_id` from
   the store (a missing one is a 404, as OpenAI answers), and translate the request into a chat request,
   which `prepare_chat` renders, tokenizes and constrains (tools, `text.format`, reasoning) exactly as
   for `/v1/chat/completions`. An error names the Responses field (`input`, `max_output_tokens`,
   `text.format`), not the chat one it came through.
2. Run it. Each step's text goes through the chat route's reply reader (thinking, answer, tool calls) into
   output items (server/responses/output.py). A stream sends `response.created`, `response.in_progress`,
   the items' events as they grow, then `response.completed` — or `response.incomplete` when
   max_output_tokens cut the reply, `response.failed` when it was aborted; otherwise the finished
   response object comes back whole. Every event has its `sequence_number`.
3. A finished response with `store: true` is kept with its conversation (server/responses/store.py).
"""

from __future__ import annotations

import logging
import re
import time

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.entrypoints.async_engine import EngineDeadError
from server.http.errors import APIError, error_response, internal_error, request_id_of, validation_error
from server.http.sse import sse_response
from server.openai.chat import PreparedChat, prepare_chat
from server.openai.output_json import Usage, chat_logprobs
from server.openai.protocol import ChatCompletionRequest
from server.responses.output import Events, OutputItems, new_id
from server.responses.protocol import ResponsesRequest, ToolChoiceFunction, input_messages
from server.responses.store import ResponseStore, StoredResponse
from server.serving.admission import Places, failed_before_engine
from server.serving.context import ServingContext

logger = logging.getLogger(__name__)

# Chat request fields -> the Responses fields they came from, for error messages.
_RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "response_format.json_schema": "text.format",
            "response_format": "text.format", "truncate_prompt_tokens": "truncation"}


async def responses_route(ctx: ServingContext, store: ResponseStore, request: Request) -> Response:
    places = Places()
    try:
        ctx.require_ready()
        body = await ctx.parse(request, ResponsesRequest)
        conversation = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise APIError(404, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            conversation = list(previous.messages)
        conversation += input_messages(body.input)
        try:
            chat = ChatCompletionRequest.model_validate(body.to_chat(conversation, ctx.model.max_model_len))
        except ValidationError as e:
            raise validation_error(e) from None
        places = ctx.admission.admit(1)
        prepared = await prepare_chat(ctx, chat)
    except APIError as e:
        return failed_before_engine(places, _renamed(e))
    except BaseException as e:
        return failed_before_engine(places, e)
    run = _Run(ctx, store, body, conversation, prepared, Events(enabled=bool(body.stream)))
    results = ctx.engine.stream(request, [prepared.request], [prepared.text], run.id, places)
    if body.stream:
        return sse_response(_events(run, results, request_id_of(request)),
                            ctx.engine.if_never_read(results, places))
    try:
        async for _, out in results:
            run.add(out)
    except EngineDeadError:
        return error_response(internal_error(request_id_of(request)))
    run.close()
    return JSONResponse(run.finish())


async def get_response_route(store: ResponseStore, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = store.get(response_id)
    if stored is None:
        return error_response(_not_found(response_id))
    return JSONResponse(stored.response)


async def delete_response_route(store: ResponseStore, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not store.delete(response_id):
        return error_response(_not_found(response_id))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def _renamed(e: APIError) -> APIError:
    """A chat-path error, with the Responses API's names for the fields."""
    error = e.body["error"]
    for old, new in _RENAMED.items():
        param = error["param"] or ""
        if param == old or param.startswith(old + "."):
            error["param"] = new + param[len(old):]
            error["message"] = re.sub(rf"^{re.escape(old)}\b", new, error["message"])
            break
    error["message"] = re.sub(r"\bmax_tokens\b", "max_output_tokens", error["message"])
    return e


async def _events(run: _Run, results, request_id: str):
    event = run.items.event
    try:
        yield event("response.created", response=run.response("in_progress"))
        yield event("response.in_progress", response=run.response("in_progress"))
        async for _, out in results:
            for line in run.add(out):
                yield line
        for line in run.close():
            yield line
        response = run.finish()
        yield event(f"response.{response['status']}", response=response)
    except Exception:  # the headers are out: report in the stream, as OpenAI does
        logger.exception("response stream %s failed", request_id)
        yield event("error", code="internal_error", message=f"internal error (request id {request_id})", param=None)


class _Run:
    """One response as it is generated: its output items, usage and final status."""

    def __init__(self, ctx: ServingContext, store: ResponseStore, body: ResponsesRequest, conversation: list[dict],
                 chat: PreparedChat, events: Events):
        self.store, self.body, self.conversation, self.params = store, body, conversation, chat.request.params
        self.model = ctx.model.served_name(chat.request)
        self.token_str = ctx.model.tokenizer.token_str
        self.id, self.created = new_id("resp"), int(time.time())
        self.reader = chat.replies.stream()
        self.items = OutputItems(events)
        self.usage = Usage([chat.prompt_ids])
        # Logprobs go with the answer text: not with thinking, nor with text that tool calls are read from.
        self.logprobs = self.params.logprobs if chat.replies.calls is None else None
        self.finish_reason: str | None = None

    def add(self, out) -> list[str]:
        self.usage.add(0, out)
        thinking = self.reader.thinking
        piece = self.reader.feed(out.new_text, len(out.new_token_ids))
        if out.finished:
            piece += self.reader.finish()
            self.finish_reason = out.outputs[0].finish_reason
        entries = None
        if self.logprobs is not None and out.new_token_ids and not thinking:
            entries = chat_logprobs(out.new_token_ids, out.new_logprobs or [], self.logprobs,
                                    self.token_str)["content"]
        return self.items.add(piece, entries)

    @property
    def status(self) -> str:
        return {"stop": "completed", "length": "incomplete"}.get(self.finish_reason, "failed")

    def close(self) -> list[str]:
        return self.items.close("completed" if self.status == "completed" else "incomplete")

    def finish(self) -> dict:
        """The finished response object; kept in the store when the request asked for it."""
        response = self.response(self.status)
        if self.body.store:
            self.store.put(self.id, StoredResponse(response, self.conversation + [self._turn()]))
        return response

    def response(self, status: str) -> dict:
        body, done = self.body, status != "in_progress"
        usage = self.usage.as_dict()
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "output": self.items.items if done else [],
            "error": {"code": "server_error", "message": "the request was aborted before it finished"}
            if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None},
            "service_tier": "default", "store": body.store is not False, "background": False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, ToolChoiceFunction)
            else body.tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools], "top_logprobs": body.top_logprobs or 0,
            "truncation": body.truncation or "disabled", "user": (body.model_extra or {}).get("user"),
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": self.reader.reasoning_tokens},
                      "total_tokens": usage["total_tokens"]} if done else None,
        }

    def _turn(self) -> dict:
        """This response's reply as the assistant turn a follow-up continues from."""
        text = "".join(p["text"] for i in self.items.items if i["type"] == "message" for p in i["content"])
        turn = {"role": "assistant", "content": text or None}
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items.items if i["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = calls
        thinking = "".join(p["text"] for i in self.items.items if i["type"] == "reasoning" for p in i["content"])
        if thinking:
            turn["reasoning_content"] = thinking
        return turn
