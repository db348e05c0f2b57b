"""The live requests, and the one place that advances them: `update_from_output(step, sampled)`.

1. `new_choices` turns a caller's request into its n choices (one `Request` each: detokenizer, grammar
   state, logprob lists); `add` hands choice 0 to the scheduler (the others follow its prefill).
2. When a step's draws reach the host, `update_from_output` takes each sequence row's accepted tokens
   (one today; several once speculative drafts are verified) and, token by token: lets the grammar
   guard it, appends it, assembles its log-probabilities, checks EOS and stop tokens, the grammar's end
   and the length limit, detokenizes it and looks for stop strings. The first token that finishes the
   choice ends the row: tokens after it are dropped, and a stop string that ends inside the span cuts
   the text there. Then it frees what finished and offers the pages the step filled to the prefix cache.
3. A draw for a request that finished, was aborted or was preempted after the step was planned is
   discarded (its epoch moved on). That is `live_rows`, which an output head that draws nothing walks
   with its own result in its host update (`jaxserve/execution/heads/`), as `update_from_output` walks
   the draws: the step's result reaches the requests in one place either way.
4. It returns a `RequestOutput` per choice that progressed, carrying what is new (text that became
   final, token ids, their log-probabilities when asked for) and, once the choice is finished, the whole
   result. Nothing on the way copies a choice's whole output, so host work follows what changed.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from jaxserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, logprob_entries
from jaxserve.sampling.closing import GrammarState, fill_masks
from jaxserve.sampling.grammar import GrammarCompiler
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.request import OutputState, Request
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.stats import EngineStats
from jaxserve.scheduling.step import SampledTokens, SampleLogprobs, ScheduledSeq, StepPlan
from jaxserve.scheduling.stop_strings import apply_stop_strings


class RequestTracker:
    def __init__(self, scheduler: Scheduler, tokenizer, grammars: GrammarCompiler, stats: EngineStats,
                 max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_ids = tuple(tokenizer.eos_token_ids)
        self.grammars = grammars
        self.stats = stats
        self.max_model_len = max_model_len
        self.requests: dict[int, Request] = {}  # every live choice, by key
        self.choices: dict[str, list[Request]] = {}  # a caller's request id -> its choices

    # ---- requests in and out ------------------------------------------------------------------------

    def suppressed_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """What min_tokens masks: the EOS tokens (unless ignored) and the stop tokens."""
        eos = () if params.ignore_eos else self.eos_ids
        return tuple(dict.fromkeys([*eos, *params.stop_token_ids]))

    def new_choices(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                    prompt: str | None, priority: int = 0, lora=None, images: tuple = (),
                    mrope=None) -> list[Request]:
        """The request's n choices, each drawing with its own seed (seed, seed + 1, ...: reproducible and
        distinct). Touches no engine state: callable from any thread."""
        max_len = self.max_model_len
        if params.max_tokens is not None:
            max_len = min(max_len, len(prompt_ids) + params.max_tokens)
        seed = params.resolved_seed()
        later = dataclasses.replace(params, prompt_logprobs=None) if params.n > 1 else params
        choices = []
        for j in range(params.n):
            p = params if j == 0 else later
            output = OutputState(
                detokenizer=self.tokenizer.new_detokenizer(prompt_ids, skip_special_tokens=p.skip_special_tokens),
                logprobs=[] if p.logprobs is not None else None,
                prompt_logprobs=[None] if p.prompt_logprobs is not None else None)
            grammar = None
            if p.structured_outputs is not None:
                grammar = GrammarState(self.grammars.matcher(p.structured_outputs), self.grammars, self.eos_ids)
            choices.append(Request(request_id, prompt_ids, p, seed=(seed + j) % 2**64, max_len=max_len, index=j,
                                   prompt=prompt, suppress_ids=self.suppressed_ids(params), output=output,
                                   grammar=grammar, priority=priority, lora=lora, images=images, mrope=mrope))
        choices[0].forks = choices[1:]
        return choices

    def add(self, choices: list[Request]) -> None:
        self.choices[choices[0].request_id] = choices
        for request in choices:
            self.requests[request.key] = request
            if request.grammar is not None:
                request.grammar.prepare_draw(len(request.token_ids), request.max_len)
        self.scheduler.add(choices[0])  # the other choices follow its prefill

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Finish every live choice of the request with "abort"; their outputs."""
        outputs = []
        for request in list(self.choices.get(request_id, ())):
            if request.key in self.requests:
                self.finish(request, "abort")
                outputs.append(self._output(request, "", []))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, request: Request, reason: str) -> None:
        """End a live choice (frees its slot and pages) and count it."""
        self.scheduler.finish(request, reason)
        del self.requests[request.key]
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        choices = self.choices.get(request.request_id, ())
        if all(c.key not in self.requests for c in choices):
            self.choices.pop(request.request_id, None)

    # ---- grammar masks for a step being launched ------------------------------------------------------

    def grammar_masks(self, step: StepPlan) -> np.ndarray | None:
        """The step's allowed-token bitmask by sequence row, when one of its draws is constrained (else
        None: nothing to transfer)."""
        rows = [(i, self.requests[seq.key].grammar) for i, seq in enumerate(step.seqs)
                if seq.constrained and seq.samples]
        return fill_masks(self.grammars, rows, len(step.seqs)) if rows else None

    # ---- the one place that advances requests ---------------------------------------------------------

    def update_from_output(self, step: StepPlan, sampled: SampledTokens) -> list[RequestOutput]:
        wants = any((seq.samples and seq.params.logprobs is not None) or seq.prompt_targets is not None
                    for seq in step.seqs)
        results = sampled.fetch_logprobs() if wants and sampled.fetch_logprobs is not None else None
        outputs = []
        first_rows = np.cumsum([0] + [seq.num_tokens for seq in step.seqs]) if results is not None else None
        for row, seq, request in self.live_rows(step):
            if results is not None and seq.prompt_targets is not None:
                self._record_prompt_logprobs(request, seq, int(first_rows[row]), results)
            if seq.samples:
                accepted = int(sampled.num_accepted[row])
                if seq.num_draft_tokens:
                    self.stats.count_drafts(seq.num_draft_tokens, accepted - 1)
                self.scheduler.accept_draws(request, seq, accepted)
                outputs.append(self._advance(request, sampled.tokens[row, :accepted], row, results))
        return outputs

    def live_rows(self, step: StepPlan) -> Iterator[tuple[int, ScheduledSeq, Request]]:
        """(row, span, request) of each span whose request still runs as planned (one that finished, was
        aborted or was preempted since is skipped); after each, the pages the step filled for it are offered
        to the prefix cache (the step wrote their K/V: later readers run after it on the device)."""
        for row, seq in enumerate(step.seqs):
            request = self.requests.get(seq.key)
            if request is None or request.epoch != seq.epoch:
                continue
            yield row, seq, request
            self.scheduler.register_full_pages(request)

    def _advance(self, request: Request, tokens: np.ndarray, row: int,
                 results: SampleLogprobs | None) -> RequestOutput:
        """Keep a row's accepted tokens, in order, until one finishes the choice."""
        texts, kept, entries = [], [], []
        k = request.params.logprobs
        for i, token in enumerate(tokens.tolist()):
            replaced = False
            if request.grammar is not None:
                token, replaced = request.grammar.accept(token, len(request.token_ids), request.max_len)
            request.token_ids.append(token)
            entry = None
            if replaced and k is not None:  # forced, as a closing token is: probability 1
                entry = {token: Logprob(0.0, 1, self.tokenizer.token_str(token))}
            elif k is not None:
                entry = logprob_entries(token, results.sample_logprob[row, i], results.sample_rank[row, i],
                                        results.top_ids[row, i], results.top_logprobs[row, i], k,
                                        self.tokenizer.token_str)
            kept.append(token)
            entries.append(entry)
            text, reason = self._keep(request, token, entry)
            texts.append(text)
            if reason is not None:
                self.finish(request, reason)
                break
        else:
            if request.grammar is not None:
                request.grammar.prepare_draw(len(request.token_ids), request.max_len)
        return self._output(request, "".join(texts), kept, entries if k is not None else None)

    def _keep(self, request: Request, token: int, entry: PositionLogprobs | None) -> tuple[str, str | None]:
        """One appended token's text and stop conditions: (text that became final, finish reason or None)."""
        out, params = request.output, request.params
        if entry is not None:
            out.logprobs.append(entry)
            out.cumulative_logprob += entry[token].logprob
        self.stats.generation_tokens += 1
        reason = None
        # EOS from a closing walk (which takes it only once the grammar accepts) ends even with ignore_eos.
        closed = request.grammar is not None and request.grammar.closed_early
        if token in self.eos_ids and (not params.ignore_eos or closed):
            reason, request.stop_reason = "stop", token
        elif token in params.stop_token_ids:
            reason, request.stop_reason = "stop", token
        # EOS / stop tokens end the text without appearing in it.
        piece = out.detokenizer.add(token) if reason is None else ""
        if reason is None and request.grammar is not None:
            reason = request.grammar.consume(token, request.request_id)  # its last token is part of the text
        if reason is None and len(request.token_ids) >= request.max_len:
            reason = "length"
        if reason is not None:
            piece += out.detokenizer.flush()
        text, stop = apply_stop_strings(out, params, piece, final=reason is not None)
        if stop is not None:
            request.stop_reason = stop
            reason = reason or "stop"
        return text, reason

    def _record_prompt_logprobs(self, request: Request, seq: ScheduledSeq, first_row: int,
                                results: SampleLogprobs) -> None:
        """Row r of the span holds the distribution of the prompt token after position start + r."""
        known = request.output.prompt_logprobs
        if known is None:
            return
        for r, target in enumerate(seq.prompt_targets):
            if seq.start + r + 1 == len(known):  # recomputed rows (after a preemption) are known already
                i = first_row + r
                known.append(logprob_entries(target, results.prompt_logprob[i], results.prompt_rank[i],
                                             results.prompt_top_ids[i], results.prompt_top_logprobs[i],
                                             request.params.prompt_logprobs, self.tokenizer.token_str))

    def _output(self, request: Request, new_text: str, new_token_ids: Sequence[int],
                new_logprobs: list[PositionLogprobs] | None = None) -> RequestOutput:
        out = request.output
        finished = request.finished
        outputs = []
        if finished:  # the whole result, assembled once
            outputs.append(CompletionOutput(
                index=request.index, text="".join(out.pieces), token_ids=request.output_ids,
                finish_reason=request.finish_reason, stop_reason=request.stop_reason, logprobs=out.logprobs,
                cumulative_logprob=None if out.logprobs is None else out.cumulative_logprob))
        prompt_logprobs = None
        if out.prompt_logprobs is not None and (finished or not out.prompt_logprobs_sent):
            prompt_logprobs, out.prompt_logprobs_sent = out.prompt_logprobs, True
        return RequestOutput(request_id=request.request_id, prompt_token_ids=request.prompt_ids, outputs=outputs,
                             finished=finished, new_text=new_text, new_token_ids=list(new_token_ids),
                             new_logprobs=new_logprobs, prompt=request.prompt,
                             num_cached_tokens=request.num_cached_tokens or 0,
                             num_output_tokens=request.num_output_tokens, index=request.index,
                             prompt_logprobs=prompt_logprobs, queue_seconds=request.queue_seconds)
