"""The engine: tokenizer + scheduler + model runner, advanced one iteration at a time.

1. `add_request` validates a prompt and its sampling settings (a `ValueError` naming the parameter,
   before anything is allocated) and queues it. Additions and aborts from other threads land in an
   inbox that the next `step` drains, so only the engine thread ever mutates scheduler state.
2. `step` asks the scheduler for the next ragged step and dispatches it, then — while the device runs
   it — reads the samples of the step before and advances every request in one place: append the
   token, detokenize incrementally, check stop conditions (EOS ids, stop_token_ids, stop strings,
   max_tokens, context length), free what finished. The host thus prepares step N+1 while the device
   runs step N; a token sampled for a request that finished meanwhile is discarded.
3. It returns a `RequestOutput` per choice that progressed, carrying what is new in this step (text
   that became final, token ids, their log-probabilities when asked for) and, once the choice is
   finished, the whole result. Nothing on the way copies a choice's whole output, so host work per step
   follows what changed. A request with n choices is n scheduler requests: choice 0 prefills the
   prompt, the others start from its pages (see the scheduler).
4. Multi-host: only process 0 (the leader) schedules and steps; the other processes build the same
   engine and `follow` the leader's device steps (see `sharding/multihost.py`). `warmup` and each burst
   of leader steps end with `end_call`, which returns the followers from `follow`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import time
import uuid
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.engine_args import EngineArgs
from jaxserve.engine.builder import build_model, BuiltModel
from jaxserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput, logprob_entries
from jaxserve.execution.runner import CompilationEvents, ModelRunner, StepOutput, WarmupReport
from jaxserve.errors import InvalidParameter
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.scheduler import Request, Scheduler, Status
from jaxserve.sampling.grammar import CLOSE_MARGIN, GrammarCompiler, GUARD_WINDOW, Matcher
from jaxserve.text.detokenizer import IncrementalDetokenizer
from sharding import multihost

logger = logging.getLogger(__name__)


class _Tracked:
    """Engine-side companions of one choice: its detokenizer, stop-string and logprob state."""

    def __init__(self, request: Request, detokenizer: IncrementalDetokenizer, prompt: str | None):
        self.request = request
        self.detokenizer = detokenizer
        self.prompt = prompt
        self.pieces: list[str] = []  # emitted text, stop strings excluded; joined once, at the end
        self.held = ""  # text withheld because it might be the start of a stop string
        self.stop_reason: int | str | None = None
        params = request.params
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Choice 0 collects them (position 0 has none); they go out with its first event and its end.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.matcher: Matcher | None = None  # structured outputs: the choice's place in its grammar
        self.closing: list[int] | None = None  # the tokens still to force to end the grammar within budget
        self.next_walk = 0  # tokens the choice will have when it next looks for a way out (Engine._closing_token)
        self.guarded = False  # close to its budget: each free draw is checked before it is kept (_guard_token)
        self.gap = self.margin = 0  # spare draws beyond the way out, and how few of them trigger closing


class Engine:
    def __init__(self, args: EngineArgs, built: BuiltModel | None = None):
        """`built`: a model assembled by the caller (`model_builder.build_from_module`); default: `build_model(args)`."""
        CompilationEvents.install()
        started = time.perf_counter()
        self.args = args
        built = built or build_model(args)
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer
        self.model_name = built.name
        self.scheduler_config = built.scheduler_config
        self.cache_config = built.cache_config
        self.sampler_config = built.sampler_config
        self.runner = ModelRunner(built.model, built.model_config, built.cache_config, built.scheduler_config,
                                  built.attention, built.dtype, built.sampler_config)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.scheduler = Scheduler(built.scheduler_config, built.cache_config)
        self.plan = built.model.plan
        self.is_leader = multihost.is_leader()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # by scheduler request id (one per choice)
        self._choices: dict[str, list[str]] = {}  # request id -> its choices' scheduler request ids
        self._in_flight: StepOutput | None = None  # the dispatched step whose samples are not read yet
        self.compilations_at_warmup: int | None = None
        # Seconds per start-up phase (weights, kv_cache, compile, total to ready), for the log and /metrics.
        self.startup_seconds = {"weights": built.weights_seconds}
        self._started = started
        self.stats = EngineStats()
        self.step_count = 0
        # Steps between an abort() call and the step that freed the request: the latency tests assert on.
        self.abort_latencies: collections.deque[int] = collections.deque(maxlen=1000)
        logger.info("model %s: %s, %d layers, dtype %s, attention %s, KV cache %d pages x %d tokens "
                    "(%.1f MB), prefix caching %s, %d slots, max_model_len %d", self.model_name,
                    self.model_config.model_type, self.model_config.num_layers,
                    jnp.dtype(built.dtype).name,
                    built.attention.name, self.cache_config.num_pages, self.cache_config.page_size,
                    self.runner.kv_abstract.num_bytes / 1e6,
                    "on" if self.cache_config.enable_prefix_caching else "off",
                    self.scheduler_config.max_num_seqs, self.scheduler_config.max_model_len)
        self.startup_seconds["kv_cache"] = time.perf_counter() - started - built.weights_seconds

    # ---- warm-up and compile accounting -------------------------------------------------------------

    def warmup(self, background: bool = False) -> float:
        """Compile every step program. With `background`, return once one program can run any step and
        compile the others while serving (`runner.warmup`); `startup_seconds["all_programs"]` and
        `warmup_report` appear when they are done."""
        start = time.perf_counter()

        def done(report: WarmupReport) -> None:
            self.startup_seconds["all_programs"] = time.perf_counter() - self._started

        if self.is_leader:
            self.runner.warmup(background=background, on_done=done)
            self.end_call()
        else:
            self.follow()
            self.startup_seconds["all_programs"] = time.perf_counter() - self._started
        self.compilations_at_warmup = CompilationEvents.lowered
        self.startup_seconds["compile"] = time.perf_counter() - start
        self.startup_seconds["total"] = time.perf_counter() - self._started
        pending = len(self.runner.layouts) - len(self.runner.ready_buckets) if self.is_leader else 0
        logger.info("ready in %.1fs: weights %.1fs, KV cache %.1fs, compilation %.1fs%s",
                    *(self.startup_seconds[k] for k in ("total", "weights", "kv_cache", "compile")),
                    f" ({pending} more step programs compiling in the background)" if pending else "")
        return time.perf_counter() - start

    @property
    def warmup_report(self) -> WarmupReport | None:
        """What warm-up compiled (None until every program is done, and on follower processes)."""
        return self.runner.warmup_report

    @property
    def multiprocess(self) -> bool:
        return self.plan.process_count > 1

    def end_call(self) -> None:
        """Leader: release the followers from `follow` (no-op in a single-process run)."""
        if self.multiprocess and self.is_leader:
            self.runner.end_call()

    def follow(self) -> int:
        """Follower: run the leader's device steps until it calls `end_call`."""
        if not self.multiprocess or self.is_leader:
            return 0
        return self.runner.follow()

    @property
    def compilations_since_warmup(self) -> int:
        if self.compilations_at_warmup is None:
            return 0
        return CompilationEvents.lowered - self.compilations_at_warmup

    # ---- requests -----------------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming the parameter; allocates nothing."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameter("sampling_params",
                                   f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise InvalidParameter("prompt", "prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidParameter("prompt", f"prompt contains token ids outside the vocabulary [0, {vocab})")
        limit = self.scheduler_config.max_model_len
        if len(prompt_ids) >= limit:
            raise InvalidParameter("prompt", f"prompt has {len(prompt_ids)} tokens but the model's context length "
                             f"(max_model_len) is {limit}: it must leave room for at least one new token")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidParameter(name, f"{name} must be token ids in [0, {vocab})")
        if params.top_k > vocab:
            raise InvalidParameter("top_k", f"top_k must be at most the vocabulary size {vocab} (or -1 / 0 "
                                   f"for no limit), got {params.top_k}")
        most = self.sampler_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > most:
                raise InvalidParameter(name, f"{name} may be at most {most} (--max-logprobs)")
        entries = len(set(params.logit_bias or ()) | set(params.allowed_token_ids or ()))
        if params.min_tokens:
            entries += len(self._suppressed_ids(params))
        if entries > self.sampler_config.max_logit_bias:
            raise InvalidParameter("logit_bias" if params.logit_bias else "allowed_token_ids",
                                   f"{entries} logit_bias / allowed_token_ids entries (with min_tokens: plus the "
                                   f"EOS and stop tokens) exceed --max-logit-bias "
                                   f"{self.sampler_config.max_logit_bias}")
        if params.n > self.scheduler_config.max_num_seqs:
            raise InvalidParameter("n", f"n may be at most --max-num-seqs ({self.scheduler_config.max_num_seqs})")
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # cached: cheap for a spec seen before

    def _suppressed_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """What min_tokens masks: the EOS tokens (unless ignored) and the stop tokens."""
        eos = () if params.ignore_eos else self.tokenizer.eos_token_ids
        return tuple(dict.fromkeys([*eos, *params.stop_token_ids]))

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> str:
        """Validate and queue a request (thread-safe): its n choices come out as RequestOutputs with
        `index` 0..n-1 under this one id. Returns the id."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        max_len = self.scheduler_config.max_model_len
        if params.max_tokens is not None:
            max_len = min(max_len, len(prompt_ids) + params.max_tokens)
        seed = params.resolved_seed()
        later = dataclasses.replace(params, prompt_logprobs=None) if params.n > 1 else params
        choices = []
        for j in range(params.n):
            # Each choice draws with its own seed: seed, seed + 1, ... (reproducible, and distinct).
            choice = Request(request_id=request_id if j == 0 else f"{request_id}#{j}", prompt_ids=prompt_ids,
                             params=params if j == 0 else later, seed=(seed + j) % 2**64, max_len=max_len,
                             choice=j, suppress_ids=self._suppressed_ids(params))
            tracked = _Tracked(choice, self.tokenizer.new_detokenizer(
                prompt_ids, skip_special_tokens=params.skip_special_tokens), prompt)
            if params.structured_outputs is not None:
                tracked.matcher = self.grammars.matcher(params.structured_outputs)
            choices.append(tracked)
        choices[0].request.forks = [t.request for t in choices[1:]]
        self._inbox.put(("add", (request_id, choices)))
        return request_id

    def abort(self, request_id: str) -> None:
        """Abort a request, every choice of it (thread-safe); slots and pages are freed at the next step."""
        self._inbox.put(("abort", (request_id, self.step_count)))

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no request is using; returns how many. Call it from the thread that
        steps the engine (or offline), never while another thread is inside `step`."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self._tracked) or not self._inbox.empty() or self._in_flight is not None

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                request_id, choices = item
                self._choices[request_id] = [t.request.request_id for t in choices]
                for tracked in choices:
                    self._tracked[tracked.request.request_id] = tracked
                self.scheduler.add(choices[0].request)  # the other choices follow its prefill
            else:
                request_id, asked_at_step = item
                choices = self._choices.get(request_id, [])
                for key in choices:
                    tracked = self._tracked.get(key)
                    if tracked is not None:
                        self._finish(tracked, "abort")
                        outputs.append(self._output(tracked, "", []))
                if choices:
                    self.abort_latencies.append(self.step_count - asked_at_step)

    # ---- the iteration ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.step_count += 1
        outputs = self._drain_inbox()
        if self._in_flight is not None and (self._in_flight.plan.prefill_only or self._grammar_waits()):
            # Read the step in flight before planning the next one, in two cases (the device idles for the
            # planning meanwhile):
            # - It only prefills. Requests arrive in bursts spread over milliseconds (a client's wave, or
            #   a batch job starting), and the first of them finds the engine idle and starts a step alone.
            #   Planned at once, the next step would hold only that request's first decode, and the rest
            #   of the burst would wait for two steps, one of them a prefill. Planned after it, the next
            #   step takes them all; and no decode waits on the planning, since none is running.
            # - A constrained sequence's next mask needs its pending token (unconstrained traffic alone
            #   never takes this path).
            outputs.extend(self._process(self._in_flight))
            self._in_flight = None
            outputs.extend(self._drain_inbox())
        self.scheduler.token_budget = self.runner.step_token_limit  # lower while programs still compile
        plan = self.scheduler.schedule()
        launched = None
        if not plan.empty:
            launched = self.runner.launch(plan, masks=self._grammar_masks(plan))
            self.stats.count_step(plan)
            for chunk in plan.chunks:
                if chunk.is_prefill:
                    self.stats.prompt_tokens += chunk.num_tokens
                    self.scheduler.register_full_pages(chunk.request)
        # While the device runs the step just launched, advance requests by the one before it.
        if self._in_flight is not None:
            outputs.extend(self._process(self._in_flight))
        self._in_flight = launched
        return outputs

    def _grammar_waits(self) -> bool:
        return any(r.constrained and r.num_pending for r in self.scheduler.slots if r is not None)

    def _grammar_masks(self, plan) -> np.ndarray | None:
        """The step's allowed-token bitmask, when one of its draws is constrained (else None: no transfer)."""
        constrained = [(self._tracked[c.request.request_id], i) for i, c in enumerate(plan.chunks)
                       if c.samples and c.request.constrained]
        if not constrained:
            return None
        masks = self.runner.open_masks(self.runner.layout_for(plan.num_tokens))
        free = []
        for tracked, row in constrained:
            forced = self._closing_token(tracked)
            if forced is None:
                free.append((tracked.matcher, row))
            else:
                masks[row] = 0
                masks[row, forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))
        if free:
            self.grammars.fill_masks(free, masks)
        for matcher, row in free:
            if matcher.error:  # out of work fuel: this draw goes unconstrained and the choice ends after it
                masks[row] = -1
        return masks

    def _closing_token(self, tracked: _Tracked) -> int | None:
        """Near the end of its token budget a constrained choice is steered to the end of its grammar, so
        its output is complete (JSON that parses) rather than cut off: once the way out the host finds is
        about as long as the draws left, its tokens are forced, one per step."""
        request = tracked.request
        drawn = request.num_tokens - 1  # the draw being planned is already counted as pending
        if tracked.closing is None and drawn >= tracked.next_walk:
            left = request.max_len - drawn  # draws left, this one included
            self._plan_closing(tracked, self.grammars.closing(tracked.matcher, 2 * left + CLOSE_MARGIN), left, drawn)
        return tracked.closing.pop(0) if tracked.closing else None

    @staticmethod
    def _plan_closing(tracked: _Tracked, path: list[int] | None, left: int, drawn: int) -> None:
        """Given the way out found with `left` draws to go after `drawn` tokens: close now, or guard each
        draw from now on, or walk again later."""
        way_out = len(path) if path is not None else 2 * left + CLOSE_MARGIN
        # One free draw can lengthen the way out a lot (entering an object whose required fields must all be
        # written): keep a margin that grows with it; the guard catches the jumps the margin misses.
        margin = CLOSE_MARGIN + way_out // 2
        gap = left - way_out
        tracked.gap, tracked.margin = gap, margin
        if path is not None and gap <= margin:
            tracked.closing, tracked.guarded = path, False
            return
        tracked.guarded = path is not None and gap <= margin + GUARD_WINDOW
        # Unguarded, each free draw shrinks the gap by about CLOSE_MARGIN + 1: walk again before it can close.
        tracked.next_walk = drawn + (1 if tracked.guarded else max(1, (gap - margin) // (CLOSE_MARGIN + 1)))

    def _guard_token(self, tracked: _Tracked, token: int) -> tuple[int, bool]:
        """A guarded choice's draw, before it is kept: if the way out after it no longer fits the draws left,
        take the first token of the way out from before it instead (the draw was not fed to the model yet,
        so nothing is undone on the device; only the penalty counts saw the drawn token). Returns the token
        to keep and whether it was replaced. The way out found after a kept token plans the next draw."""
        request = tracked.request
        if token in self.tokenizer.eos_token_ids:
            return token, False
        tokens_after = len(request.token_ids) + 1
        if self.grammars.keeps_way_out(tracked.matcher, token):  # most draws: no walk needed
            tracked.gap -= 1
            tracked.next_walk = tokens_after + (tracked.gap > tracked.margin)  # walk, and close, once it is spent
            return token, False
        left = request.max_len - tokens_after  # draws left once this token is kept
        after = self.grammars.closing(tracked.matcher, 2 * left + CLOSE_MARGIN, after=token)
        if after is not None and len(after) <= left:
            self._plan_closing(tracked, after, left, tokens_after)
            return token, False
        instead = self.grammars.closing(tracked.matcher, left + 1)
        if instead is None:  # no way out from before the draw either: keep it (best effort)
            return token, False
        tracked.closing, tracked.guarded = instead[1:], False
        return instead[0], True

    def _process(self, done: StepOutput) -> list[RequestOutput]:
        tokens = done.tokens()
        chunks = done.plan.chunks
        wants = any((c.samples and c.request.params.logprobs is not None)
                    or (c.is_prefill and c.request.params.prompt_logprobs is not None) for c in chunks)
        results = done.logprobs() if wants else None
        outputs, first_row = [], 0
        for row, chunk in enumerate(chunks):
            tracked = self._tracked.get(chunk.request.request_id)
            if results is not None and tracked is not None and tracked.prompt_logprobs is not None \
                    and chunk.is_prefill and chunk.epoch == chunk.request.epoch:
                self._record_prompt_logprobs(tracked, chunk, first_row, results)
            first_row += chunk.num_tokens
            if chunk.samples:
                token, replaced = int(tokens[row]), False
                if tracked is not None and tracked.guarded and chunk.epoch == chunk.request.epoch:
                    token, replaced = self._guard_token(tracked, token)
                if self.scheduler.accept_token(chunk, token):
                    entry = None
                    k = chunk.request.params.logprobs
                    if replaced and k is not None:  # forced, as a closing token is: probability 1
                        entry = {token: Logprob(0.0, 1, self.tokenizer.token_str(token))}
                    elif k is not None:
                        entry = logprob_entries(token, results.sample_logprob[row], results.sample_rank[row],
                                                results.top_ids[row], results.top_logprobs[row], k,
                                                self.tokenizer.token_str)
                    outputs.append(self._advance(tracked, token, entry))
        return outputs

    def _record_prompt_logprobs(self, tracked: _Tracked, chunk, first_row: int, results) -> None:
        """Row r of the chunk holds the distribution of the prompt token after position start + r."""
        request, k = tracked.request, chunk.request.params.prompt_logprobs
        for r in range(chunk.num_tokens):
            position = chunk.start + r + 1
            if position >= request.num_prompt_tokens:
                break
            if position == len(tracked.prompt_logprobs):  # recomputed rows (after a preemption) are known
                i = first_row + r
                tracked.prompt_logprobs.append(logprob_entries(
                    request.token_ids[position], results.prompt_logprob[i], results.prompt_rank[i],
                    results.prompt_top_ids[i], results.prompt_top_logprobs[i], k, self.tokenizer.token_str))

    def _advance(self, tracked: _Tracked, token: int, entry: PositionLogprobs | None = None) -> RequestOutput:
        request = tracked.request
        if entry is not None:
            tracked.logprobs.append(entry)
            tracked.cumulative_logprob += entry[token].logprob
        params = request.params
        self.stats.generation_tokens += 1
        finish_reason = None
        # EOS from a closing walk (which takes it only once the grammar accepts) ends even with ignore_eos.
        if token in self.tokenizer.eos_token_ids and (not params.ignore_eos or tracked.closing is not None):
            finish_reason, tracked.stop_reason = "stop", token
        elif token in params.stop_token_ids:
            finish_reason, tracked.stop_reason = "stop", token
        # EOS / stop tokens end the text without appearing in it.
        piece = tracked.detokenizer.add(token) if finish_reason is None else ""
        if finish_reason is None and tracked.matcher is not None:
            finish_reason = self._follow_grammar(tracked, token)  # the grammar's last token is part of the text
        if finish_reason is None and len(request.token_ids) >= request.max_len:
            finish_reason = "length"
        if finish_reason is not None:
            piece += tracked.detokenizer.flush()
        new_text = self._apply_stop_strings(tracked, piece, final=finish_reason is not None)
        if tracked.stop_reason is not None and finish_reason is None:
            finish_reason = "stop"  # a stop string matched
        if finish_reason is not None:
            self._finish(tracked, finish_reason)
        return self._output(tracked, new_text, [token], None if entry is None else [entry])

    def _follow_grammar(self, tracked: _Tracked, token: int) -> str | None:
        """Advance the choice's grammar by its token: "stop" once the grammar is complete (also when a closing
        walk steered it there: the output is whole, as vLLM reports a grammar that ended), "abort" if the
        token broke it (only when the grammar ran out of work limits and its draw went unconstrained)."""
        matcher = tracked.matcher
        if not matcher.consume(token):
            logger.warning("request %s: structured output ended: %s", tracked.request.request_id,
                           matcher.error or "the grammar refused a token")
            return "abort"
        return "stop" if matcher.done else None

    def _apply_stop_strings(self, tracked: _Tracked, piece: str, final: bool) -> str:
        """Append `piece`, cutting at the first stop string; hold back a possible stop-string prefix."""
        stops = tracked.request.params.stop
        if not stops:
            tracked.pieces.append(piece)
            return piece
        pending = tracked.held + piece
        hits = [(pending.find(s), s) for s in stops if s in pending]
        if hits:
            cut, stop = min(hits)
            end = cut + len(stop) if tracked.request.params.include_stop_str_in_output else cut
            emitted, tracked.held, tracked.stop_reason = pending[:end], "", stop
        elif final:
            emitted, tracked.held = pending, ""
        else:
            keep = max(len(s) - 1 for s in stops)
            # Withhold only a suffix that could still grow into a stop string.
            hold = next((n for n in range(min(keep, len(pending)), 0, -1)
                         if any(s.startswith(pending[-n:]) for s in stops)), 0)
            emitted, tracked.held = pending[:len(pending) - hold], pending[len(pending) - hold:]
        tracked.pieces.append(emitted)
        return emitted

    def _finish(self, tracked: _Tracked, reason: str) -> None:
        request = tracked.request
        self.scheduler.finish(request, reason)
        del self._tracked[request.request_id]
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        owner = self._owner(request)
        if all(key not in self._tracked for key in self._choices.get(owner, ())):
            self._choices.pop(owner, None)

    @staticmethod
    def _owner(request: Request) -> str:
        """The id the caller gave (choice j > 0 is scheduled as `id#j`)."""
        return request.request_id.rsplit("#", 1)[0] if request.choice else request.request_id

    def _output(self, tracked: _Tracked, new_text: str, new_token_ids: list[int],
                new_logprobs: list[PositionLogprobs] | None = None) -> RequestOutput:
        r = tracked.request
        finished = r.status is Status.FINISHED
        outputs = []
        if finished:  # the whole result, assembled once
            outputs.append(CompletionOutput(index=r.choice, text="".join(tracked.pieces), token_ids=r.output_ids,
                                            finish_reason=r.finish_reason, stop_reason=tracked.stop_reason,
                                            logprobs=tracked.logprobs,
                                            cumulative_logprob=None if tracked.logprobs is None
                                            else tracked.cumulative_logprob))
        prompt_logprobs = None
        if tracked.prompt_logprobs is not None and (finished or not tracked.prompt_logprobs_sent):
            prompt_logprobs, tracked.prompt_logprobs_sent = tracked.prompt_logprobs, True
        return RequestOutput(request_id=self._owner(r), prompt_token_ids=r.prompt_ids, outputs=outputs,
                             finished=finished, new_text=new_text, new_token_ids=new_token_ids,
                             new_logprobs=new_logprobs, prompt=tracked.prompt,
                             num_cached_tokens=r.num_cached_tokens or 0, num_output_tokens=r.num_output_tokens,
                             index=r.choice, prompt_logprobs=prompt_logprobs, queue_seconds=r.queue_seconds)


@dataclasses.dataclass
class EngineStats:
    prompt_tokens: int = 0  # prefilled tokens: cache hits excluded, recomputation after preemption included
    generation_tokens: int = 0
    finished: dict = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.time)
    # Device steps launched, and the sequences and tokens they held (padding excluded). Their ratios are the
    # batching a load got: sequences per step is what continuous batching raises with concurrency.
    steps: int = 0
    step_sequences: int = 0
    step_tokens: int = 0

    def count_step(self, plan) -> None:
        self.steps += 1
        self.step_sequences += len(plan.chunks)
        self.step_tokens += plan.num_tokens
