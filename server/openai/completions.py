"""`POST /v1/completions`: prompts in, n choices per prompt out, streamed or whole.

1. Admit every (prompt, choice) against the queue limit, tokenize on a worker thread, build the settings
   and have the engine check each prompt once (server/openai/sampling.py). `echo` returns the prompt
   before the completion; `echo` with `max_tokens: 0` scores the prompt only (one token is generated for
   the prefill's sake and dropped, as vLLM does), which is what evaluation harnesses send with `logprobs`
   to get the prompt's log-probabilities.
2. Choice k of the response is prompt k // n, choice k % n (OpenAI's order).
3. Streaming sends each choice's new text (and logprobs) as it becomes final, then its finish reason;
   otherwise the choices are assembled at the end.
"""

from __future__ import annotations

import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxserve.entrypoints.async_engine import EngineDeadError
from jaxserve.outputs import CompletionOutput
from server.http.errors import error_response, internal_error, request_id_of
from server.http.sse import event_stream, sse
from server.openai.output_json import Usage, completion_logprobs, prompt_logprobs_json
from server.openai.protocol import CompletionRequest
from server.openai.sampling import engine_requests
from server.serving.admission import Places, failed_before_engine
from server.serving.context import ServingContext


async def completions_route(ctx: ServingContext, request: Request) -> Response:
    places = Places()
    try:
        ctx.require_ready()
        body = await ctx.parse(request, CompletionRequest)
        prompts = body.prompts()
        places = ctx.admission.admit(len(prompts) * body.n)
        for p in prompts:
            if isinstance(p, str):
                ctx.model.prompt_fits(p)
        tok = ctx.model.tokenizer
        prompt_ids = await run_in_threadpool(lambda: [
            ctx.model.truncate(tok.encode(p, body.add_special_tokens) if isinstance(p, str) else list(p),
                               body.truncate_prompt_tokens) for p in prompts])
        score_only = body.echo and body.max_tokens == 0
        # Off the event loop: a new structured-output grammar is compiled here.
        checked = await run_in_threadpool(engine_requests, ctx, body, prompt_ids,
                                          1 if score_only else body.max_tokens, body.logprobs,
                                          body.logprobs if body.echo else None)
        echoes = None
        if body.echo:
            echoes = [p if isinstance(p, str) else await run_in_threadpool(tok.decode, ids, False)
                      for p, ids in zip(prompts, prompt_ids)]
    except BaseException as e:
        return failed_before_engine(places, e)
    view = _View(ctx.model.tokenizer.token_str, body, prompt_ids, echoes, score_only)
    texts = [p if isinstance(p, str) else None for p in prompts]
    envelope = {"id": ctx.response_id(request, body, "cmpl"), "object": "text_completion",
                "created": int(time.time()), "model": ctx.model.served_name(checked[0])}
    results = ctx.engine.stream(request, checked, texts, envelope["id"], places)
    usage = Usage(prompt_ids)
    if body.stream:
        return event_stream(_events(view, results, usage, envelope), request_id_of(request),
                            ctx.engine.if_never_read(results, places))
    finals: dict[int, CompletionOutput] = {}
    try:
        async for i, out in results:
            k = i * body.n + out.index
            usage.add(k, out, counted=not score_only)
            view.note_prompt_logprobs(i, out)
            if out.finished:
                finals[k] = out.outputs[0]
    except EngineDeadError:
        return error_response(internal_error(request_id_of(request)))
    choices = [view.final_choice(k, finals[k]) for k in sorted(finals)]
    return JSONResponse({**envelope, "choices": choices, "usage": usage.as_dict()})


async def _events(view: "_View", results, usage: Usage, envelope: dict):
    body = view.body
    started: set[int] = set()
    async for i, out in results:
        k = i * body.n + out.index
        usage.add(k, out, counted=not view.score_only)
        view.note_prompt_logprobs(i, out)
        text, ids, entries = ("", [], []) if view.score_only else (out.new_text, out.new_token_ids,
                                                                    out.new_logprobs or [])
        if body.echo and k not in started:  # the prompt comes first, once per choice
            text = view.echoes[i] + text
            ids, entries = view.prompt_ids[i] + ids, view.prompt_entries(i) + entries
        started.add(k)
        if not (text or out.finished or (body.logprobs is not None and ids)):
            continue
        choice = {"index": k, "text": text, "logprobs": view.logprobs(ids, entries),
                  "finish_reason": out.finish_reason,
                  "stop_reason": out.outputs[0].stop_reason if out.finished else None}
        if body.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        event = {**envelope, "choices": [choice]}
        if view.body.continuous_usage:
            event["usage"] = usage.as_dict()
        yield sse(event)
    if body.include_usage:
        yield sse({**envelope, "choices": [], "usage": usage.as_dict()})
    yield "data: [DONE]\n\n"


class _View:
    """How one request's outputs read in the response: echo, logprobs, token ids."""

    def __init__(self, token_str, body: CompletionRequest, prompt_ids, echoes, score_only: bool):
        self.body, self.prompt_ids, self.echoes, self.score_only = body, prompt_ids, echoes, score_only
        self.token_str = token_str
        self.prompt_lps: dict[int, list] = {}  # per prompt, from its choice 0

    def note_prompt_logprobs(self, i: int, out) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_lps[i] = out.prompt_logprobs

    def prompt_entries(self, i: int) -> list:
        return list(self.prompt_lps.get(i) or [None] * len(self.prompt_ids[i]))

    def logprobs(self, ids: list[int], entries: list) -> dict | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(ids, entries, self.body.logprobs, self.token_str,
                                   self.body.return_tokens_as_token_ids)

    def final_choice(self, k: int, final: CompletionOutput) -> dict:
        i = k // self.body.n
        text, ids, entries = ("", [], []) if self.score_only else (final.text, final.token_ids,
                                                                    final.logprobs or [])
        if self.body.echo:
            text = self.echoes[i] + text
            ids, entries = self.prompt_ids[i] + ids, self.prompt_entries(i) + entries
        choice = {"index": k, "text": text, "logprobs": self.logprobs(ids, entries),
                  "finish_reason": final.finish_reason, "stop_reason": final.stop_reason}
        if self.body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_lps.get(i))
        if self.body.return_token_ids:
            choice["token_ids"] = [] if self.score_only else final.token_ids
            choice["prompt_token_ids"] = self.prompt_ids[i]
        return choice
