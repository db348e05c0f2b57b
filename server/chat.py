"""`POST /v1/chat/completions`: messages in, n assistant replies out, streamed or whole.

1. Admit the request's n choices, render the chat template and tokenize on worker threads, build the
   settings (`logprobs: true` with `top_logprobs` alternatives per token).
2. With `echo` and a final assistant message, every reply starts with that message's text (vLLM's
   meaning); with `continue_final_message` the prompt ends inside that message, so the reply continues it.
3. Streaming sends a role chunk per choice, its content as it becomes final, then its finish reason;
   otherwise the replies are assembled at the end.
"""

from __future__ import annotations

import time
import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.async_engine import EngineDeadError
from jaxserve.outputs import CompletionOutput
from server.errors import APIError, error_response, internal_error, request_id_of
from server.protocol import ChatCompletionRequest
from server.responses import Usage, chat_logprobs, event_stream, prompt_logprobs_json, sse


async def chat_route(api, request: Request) -> Response:
    admitted = 0
    try:
        api.require_ready()
        body: ChatCompletionRequest = await api.parse(request, ChatCompletionRequest)
        api.admit(body.n)
        admitted = body.n
        for i, m in enumerate(body.messages):
            api.prompt_fits(m.text, f"messages.{i}.content")
        text = await run_in_threadpool(api.render_chat, body)
        api.prompt_fits(text, "messages")
        # The template writes any BOS itself: by default encode adds nothing more.
        ids = await run_in_threadpool(api.engine.tokenizer.encode, text, body.add_special_tokens)
        prompt_ids = [api.truncate(ids, body.truncate_prompt_tokens)]
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = api.check_and_build(body, prompt_ids, body.max_tokens, logprobs)
    except APIError as e:
        api.in_flight -= admitted
        return error_response(e)
    except BaseException:
        api.in_flight -= admitted
        raise
    last = body.messages[-1]
    prefix = last.text if body.echo and last.role == "assistant" else ""
    token_str = api.engine.tokenizer.token_str

    def logprobs_of(ids, entries):
        if logprobs is None:
            return None
        return chat_logprobs(ids, entries, logprobs, token_str, body.return_tokens_as_token_ids)

    envelope = {"id": f"chatcmpl-{body.request_id or uuid.uuid4().hex}", "created": int(time.time()),
                "model": api.engine.model_name}
    results = api.results(request, prompt_ids, params, [text])
    usage = Usage(prompt_ids)
    if body.stream:
        chunk = {**envelope, "object": "chat.completion.chunk"}

        async def events():
            for k in range(body.n):
                yield sse({**chunk, "choices": [{"index": k, "delta": {"role": "assistant", "content": prefix},
                                                 "logprobs": None, "finish_reason": None}]})
            async for _, out in results:
                usage.add(out.index, out)
                if out.new_text or (logprobs is not None and out.new_token_ids):
                    delta = {"index": out.index, "delta": {"content": out.new_text},
                             "logprobs": logprobs_of(out.new_token_ids, out.new_logprobs or []),
                             "finish_reason": None}
                    if body.return_token_ids:
                        delta["token_ids"] = out.new_token_ids
                    yield sse({**chunk, "choices": [delta], **_usage_if(body, usage)})
                if out.finished:
                    final = out.outputs[0]
                    yield sse({**chunk, "choices": [{"index": out.index, "delta": {}, "logprobs": None,
                                                     "finish_reason": final.finish_reason,
                                                     "stop_reason": final.stop_reason}], **_usage_if(body, usage)})
            if body.include_usage:
                yield sse({**chunk, "choices": [], "usage": usage.as_dict()})
            yield "data: [DONE]\n\n"
        return event_stream(events(), request_id_of(request))

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
        choice = {"index": k, "message": {"role": "assistant", "content": prefix + final.text},
                  "logprobs": logprobs_of(final.token_ids, final.logprobs or []),
                  "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = final.token_ids
        choices.append(choice)
    reply = {**envelope, "object": "chat.completion", "choices": choices, "usage": usage.as_dict()}
    if body.prompt_logprobs is not None:
        reply["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    if body.return_token_ids:
        reply["prompt_token_ids"] = prompt_ids[0]
    return JSONResponse(reply)


def _usage_if(body: ChatCompletionRequest, usage: Usage) -> dict:
    return {"usage": usage.as_dict()} if body.continuous_usage else {}
