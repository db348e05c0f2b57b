"""`POST /v1/chat/completions`: messages in, n assistant replies out, streamed or whole.

1. Admit the request's n choices, render the chat template and tokenize on worker threads, build the
   settings (`logprobs: true` with `top_logprobs` alternatives per token) and have the engine check them
   once (server/openai/sampling.py).
2. With `echo` and a final assistant message, every reply starts with that message's text (vLLM's
   meaning); with `continue_final_message` the prompt ends inside that message, so the reply continues it.
3. Streaming sends a role chunk per choice, its content as it becomes final, then its finish reason;
   otherwise the replies are assembled at the end.
4. Tools (server/tools/calls.py): "required" and a named function constrain the reply to calls; "auto"
   parses the free reply with the server's --tool-call-parser. Calls go out as `tool_calls`, streamed as
   argument pieces, and a reply that ended with calls ends with finish_reason "tool_calls".
5. With --reasoning-parser the thinking goes out as `reasoning_content` (and `reasoning`, vLLM's newer
   name), apart from `content`; tools and structured outputs apply to the answer after it
   (server/replies/reader.py). `prepare_chat` is also the Responses API's way in
   (server/responses/routes.py).
6. Image parts (`image_url`) go through server/openai/images.py: limits, loading, preprocessing and the
   prompt's image tokens, up to the engine, which does not take images yet (a 400 that says so).
"""

from __future__ import annotations

import dataclasses
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.entrypoints.async_engine import EngineDeadError
from jaxserve.outputs import CompletionOutput
from jaxserve.scheduling.validation import CheckedRequest
from server.http.errors import APIError, error_response, internal_error, request_id_of
from server.http.sse import event_stream, sse
from server.openai.output_json import Usage, chat_logprobs, prompt_logprobs_json, tool_call_delta_json, tool_call_json
from server.openai.images import image_prompt
from server.openai.prompts import render_chat, template_messages
from server.openai.protocol import ChatCompletionRequest
from server.openai.sampling import engine_requests
from server.replies.reader import Piece, Replies
from server.replies.reasoning import END
from server.serving.admission import Places, failed_before_engine
from server.serving.context import ServingContext


@dataclasses.dataclass
class PreparedChat:
    """A chat request ready for the engine."""
    text: str  # the rendered prompt
    prompt_ids: list[int]
    request: CheckedRequest  # what the engine checked and will run: settings, adapter
    replies: Replies  # how its replies read: thinking, answer, tool calls


async def prepare_chat(ctx: ServingContext, body: ChatCompletionRequest) -> PreparedChat:
    """Everything before the engine, for a parsed chat request. The caller has admitted body.n requests.
    Raises APIError."""
    if body.tool_mode == "auto" and body.tools:
        if not ctx.options.tool_call_parser:
            raise APIError(400, '"auto" tool choice (the default when tools are given) needs a server started '
                                'with --enable-auto-tool-choice and --tool-call-parser; or send tool_choice '
                                '"required", "none" or a named function', param="tool_choice")
        if ctx.options.tool_call_parser == "mistral":
            body.skip_special_tokens = False  # its calls start with the special token [TOOL_CALLS]
    if not body.include_reasoning and ctx.reasoning is None:
        raise APIError(400, "include_reasoning: false needs a server started with --reasoning-parser",
                       param="include_reasoning", code="unsupported_parameter")
    for i, m in enumerate(body.messages):
        ctx.model.prompt_fits(m.text, f"messages.{i}.content")
    messages, images = template_messages(body)
    prompt = await image_prompt(ctx, body, messages, images) if images else None
    if prompt is None:
        text = await run_in_threadpool(render_chat, ctx, body, messages)
        ctx.model.prompt_fits(text, "messages")
        # The template writes any BOS itself: by default encode adds nothing more.
        ids = await run_in_threadpool(ctx.model.tokenizer.encode, text, body.add_special_tokens)
    else:  # rendered, expanded and tokenized with its images
        text, ids = prompt.text, prompt.token_ids
        if body.truncate_prompt_tokens is not None:  # cutting the front would cut through the images' tokens
            raise APIError(400, "truncate_prompt_tokens cannot be used with images", param="truncate_prompt_tokens")
    prompt_ids = [ctx.model.truncate(ids, body.truncate_prompt_tokens)]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    replies = Replies(body, ctx.options.tool_call_parser, ctx.reasoning, text)
    # Off the event loop: a new structured-output grammar is compiled here. While the reply thinks, the
    # grammar waits for the end of the thinking.
    checked = await run_in_threadpool(engine_requests, ctx, body, prompt_ids, body.max_tokens, logprobs, None,
                                      END if replies.thinking else None)
    if prompt is not None:
        checked[0] = ctx.engine.attach_images(checked[0], prompt.images)
    return PreparedChat(text, prompt_ids[0], checked[0], replies)


async def chat_route(ctx: ServingContext, request: Request) -> Response:
    places = Places()
    try:
        ctx.require_ready()
        body = await ctx.parse(request, ChatCompletionRequest)
        places = ctx.admission.admit(body.n)
        chat = await prepare_chat(ctx, body)
    except BaseException as e:
        return failed_before_engine(places, e)
    replies = chat.replies
    logprobs = chat.request.params.logprobs
    last = body.messages[-1]
    prefix = last.text if body.echo and last.role == "assistant" else ""
    token_str = ctx.model.tokenizer.token_str

    def logprobs_of(ids, entries):
        if logprobs is None:
            return None
        return chat_logprobs(ids, entries, logprobs, token_str, body.return_tokens_as_token_ids)

    envelope = {"id": ctx.response_id(request, body, "chatcmpl"), "created": int(time.time()),
                "model": ctx.model.served_name(chat.request)}
    results = ctx.engine.stream(request, [chat.request], [chat.text], envelope["id"], places)
    usage = Usage([chat.prompt_ids])
    if body.stream:
        chunk = {**envelope, "object": "chat.completion.chunk"}
        streams = {k: replies.stream() for k in range(body.n)}

        def choice_chunk(index: int, delta: dict, out=None, finish_reason=None, stop_reason=None) -> str:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": logprobs_of(out.new_token_ids, out.new_logprobs or []) if out else None}
            if stop_reason is not None or finish_reason is not None:
                choice["stop_reason"] = stop_reason
            if out is not None and body.return_token_ids:
                choice["token_ids"] = out.new_token_ids
            return sse({**chunk, "choices": [choice], **_usage_if(body, usage)})

        async def events():
            for k in range(body.n):
                yield choice_chunk(k, {"role": "assistant", "content": prefix})
            async for _, out in results:
                usage.add(out.index, out)
                stream = streams[out.index]
                piece = stream.feed(out.new_text, len(out.new_token_ids))
                if out.finished:
                    piece += stream.finish()
                delta = _delta(piece)
                if delta or (logprobs is not None and out.new_token_ids):
                    yield choice_chunk(out.index, delta or {"content": ""}, out)
                if out.finished:
                    final = out.outputs[0]
                    yield choice_chunk(out.index, {}, finish_reason=_finish_reason(final, stream.called),
                                       stop_reason=final.stop_reason)
            if body.include_usage:
                yield sse({**chunk, "choices": [], "usage": usage.as_dict()})
            yield "data: [DONE]\n\n"
        return event_stream(events(), request_id_of(request), ctx.engine.if_never_read(results, places))

    finals: dict[int, CompletionOutput] = {}
    prompt_lps = None
    try:
        async for _, out in results:
            usage.add(out.index, out)
            prompt_lps = out.prompt_logprobs or prompt_lps
            if out.finished:
                finals[out.index] = out.outputs[0]
    except EngineDeadError:
        return error_response(internal_error(request_id_of(request)))
    choices = []
    for k in sorted(finals):
        final = finals[k]
        parsed = replies.parse(final.text)
        message = {"role": "assistant", "content": prefix + (parsed.content or "")}
        if replies.calls is not None and (parsed.tool_calls or body.tool_mode != "auto"):
            message["content"] = parsed.content
            message["tool_calls"] = [tool_call_json(call) for call in parsed.tool_calls]
        if parsed.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = parsed.reasoning
            message["content"] = message["content"] or None  # it only thought (vLLM's reading)
        choice = {"index": k, "message": message, "logprobs": logprobs_of(final.token_ids, final.logprobs or []),
                  "finish_reason": _finish_reason(final, bool(message.get("tool_calls"))),
                  "stop_reason": final.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = final.token_ids
        choices.append(choice)
    reply = {**envelope, "object": "chat.completion", "choices": choices, "usage": usage.as_dict()}
    if body.prompt_logprobs is not None:
        reply["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    if body.return_token_ids:
        reply["prompt_token_ids"] = chat.prompt_ids
    return JSONResponse(reply)


def _finish_reason(final: CompletionOutput, called: bool) -> str:
    """A reply that ended on its own with tool calls in it ends for them; one cut by max_tokens still says so."""
    return "tool_calls" if called and final.finish_reason == "stop" else final.finish_reason


def _delta(piece: Piece) -> dict:
    """One chunk's delta: thinking (under both names vLLM has used), content and tool-call pieces."""
    delta = {"reasoning_content": piece.reasoning, "reasoning": piece.reasoning} if piece.reasoning else {}
    if piece.content:
        delta["content"] = piece.content
    if piece.tool_calls:
        delta["tool_calls"] = [tool_call_delta_json(d) for d in piece.tool_calls]
    return delta


def _usage_if(body: ChatCompletionRequest, usage: Usage) -> dict:
    return {"usage": usage.as_dict()} if body.continuous_usage else {}
