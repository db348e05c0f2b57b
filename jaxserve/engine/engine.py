"""The engine loop: schedule a step, launch it on the device, advance requests by the step before.

1. `add_request` validates a prompt and its sampling settings (`check_request`: a `ValueError` naming the
   parameter, before anything is allocated) and queues its choices (`submit`); `pooling` (`pooling_requests.py`)
   takes prompts to embed the same way (`jaxserve/pooling/`). Additions and aborts from other threads land in an inbox that
   the next `step` drains, so only the engine thread ever mutates request state.
2. `step` asks the scheduler for the next step (plain data), launches it on the device without waiting,
   then, while the device runs it, reads the result of the step before and hands it to the host update of
   the output head chosen at start (`execution/heads/`; the draw head's: `scheduling/update.py`), the one
   place that advances requests. The host thus prepares step N+1 while the device runs step N; a result
   for a request that finished meanwhile is discarded.
3. It returns a `RequestOutput` per choice that progressed: what is new in this step and, once finished, all.
4. Step times feed the scheduler's step-time model (`timing`: `step_timing.py`, `scheduling/step_cost.py`):
   idle steps timed at warm-up, then each step the host waited for, from when the device could start it to
   its samples.
   With LoRA, `self.lora` (`jaxserve/lora/manager.py`) reads each request's adapter at `add_request`
   and fills the device slots the scheduler asks for at admission.
5. Multi-host: the runner of each process knows its part (`jaxserve/execution/relay.py`); the engine runs
   the same code everywhere, and its caller wraps each call in `call`.
"""

from __future__ import annotations

import collections
import logging
import queue
import time
import uuid
from typing import Callable, Sequence, TypeVar

import jax.numpy as jnp

from jaxserve.engine.builder import BuiltModel, build_model
from jaxserve.engine.pooling_requests import PoolingRequests
from jaxserve.engine.startup import BUILD, WARMUP, start_phase
from jaxserve.engine.step_timing import StepTiming
from jaxserve.engine.precision import Precision
from jaxserve.engine_args import EngineArgs
from jaxserve.errors import WrongRunner
from jaxserve.execution.compile_events import CompileEvents
from jaxserve.execution.compiler import WarmupReport
from jaxserve.execution.heads import head_for
from jaxserve.execution.kv_budget import page_bytes
from jaxserve.execution.relay import runner_for_this_process
from jaxserve.execution.runner import LaunchedStep
from jaxserve.lora.manager import LoRAConfig, LoRAManager, resolve_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import LoRASlots
from jaxserve.outputs import RequestOutput
from jaxserve.sampling.grammar import GrammarCompiler
from jaxserve.sampling.params import SamplingParams
from jaxserve.scheduling.scheduler import Scheduler
from jaxserve.scheduling.stats import EngineStats
from jaxserve.scheduling.update import RequestTracker
from jaxserve.scheduling.validation import CheckedRequest, validate_priority, validate_request
from jaxserve.speculative.build import build_speculator, target_programs
from sharding import multihost

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Engine:
    @start_phase(BUILD)
    def __init__(self, args: EngineArgs, built: BuiltModel | None = None):
        """`built`: a model assembled by the caller (`builder.build_from_module`); default: `build_model(args)`."""
        started = time.perf_counter()
        self.args = args
        built = built or build_model(args)
        self.model_config = built.model_config
        self.tokenizer = built.tokenizer
        self.model_name = built.name
        self.scheduler_config = built.scheduler_config
        self.cache_config = built.cache_config
        self.sampler_config = built.sampler_config
        self.plan = built.model.plan
        self.runner_type = built.runner  # "generate" or "pooling"
        self.compile_events = CompileEvents()
        lora_config = LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None
        slots = None if lora_config is None else LoRASlots(built.model_config, lora_config.max_loras,
                                                           lora_config.max_lora_rank, built.dtype, self.plan)
        self.runner = runner_for_this_process(built.model, built.model_config, built.cache_config,
                                              built.scheduler_config, built.attention, built.dtype,
                                              built.sampler_config, self.compile_events, lora=slots,
                                              head=head_for(built.runner, built.sampler_config.max_logprobs),
                                              compiler_options=built.compiler_options,
                                              **target_programs(args.speculative_config),
                                              image_rows=built.images.rows)
        self.lora = None if slots is None else LoRAManager.start(lora_config, built.model_config, slots,
                                                                 self.runner.write_lora, args.lora_modules)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.images = built.images  # a vision model's (`images.py`): it refuses images for any other
        self.scheduler = Scheduler(built.scheduler_config, built.cache_config, self.lora, built.images.scheduling)
        self.stats = EngineStats()
        self.tracker = RequestTracker(self.scheduler, self.tokenizer, self.grammars, self.stats,
                                      self.scheduler_config.max_model_len)
        self.speculator = build_speculator(args.speculative_config, built, self.runner, self.scheduler)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: LaunchedStep | None = None  # the launched step whose draws are not read yet
        self.timing = StepTiming(self.runner, self.scheduler, self.speculator)
        self.pooling = PoolingRequests(built.pooler_config, self.model_config, self.scheduler_config,
                                       lambda requests: self._inbox.put(("add", requests)))
        self.compilations_at_warmup: int | None = None
        # Seconds per start-up phase (weights, kv_cache, compile, total to ready), for the log and /metrics.
        self.startup_seconds = {"weights": built.weights_seconds}
        self._started = started
        self.step_count = 0
        # Steps between an abort() call and the step that freed the request: the latency tests assert on.
        self.abort_latencies: collections.deque[int] = collections.deque(maxlen=1000)
        logger.info("model %s: %s, %d layers, dtype %s, attention %s, KV cache %d pages x %d tokens "
                    "(%.1f MB), prefix caching %s, %d slots, max_model_len %d", self.model_name,
                    self.model_config.model_type, self.model_config.num_layers, jnp.dtype(built.dtype).name,
                    built.attention.name, self.cache_config.num_pages, self.cache_config.page_size,
                    self.runner.kv_abstract.num_bytes / 1e6, "on" if self.cache_config.enable_prefix_caching else "off",
                    self.scheduler_config.max_num_seqs, self.scheduler_config.max_model_len)
        self.precision = Precision.of(built.model_config, built.dtype, built.model.params, self.runner.kv_abstract,
                                      page_bytes(built.model_config, 1, self.runner.kv_abstract.page_dtype),
                                      built.attention.name)
        logger.info("%s", self.precision.describe())
        self.startup_seconds["kv_cache"] = time.perf_counter() - started - built.weights_seconds

    # ---- warm-up, compile accounting, the caller's calls ------------------------------------------------

    @start_phase(WARMUP)
    def warmup(self, background: bool = False) -> float:
        """Compile every step program. With `background`, return once one program can run any step and
        compile the others while serving; `startup_seconds["all_programs"]` and `warmup_report` appear
        when they are done."""
        start = time.perf_counter()
        self.runner.warmup(background=background, on_done=lambda report: self.startup_seconds.update(
            all_programs=time.perf_counter() - self._started))
        if self.speculator is not None:
            self.speculator.warmup()
        self.compilations_at_warmup = self.compile_events.lowered
        self.startup_seconds["compile"] = time.perf_counter() - start  # the step timings below are not compiling
        if self.calibration_due:  # with programs still compiling on a thread, a timing would be off
            self.calibrate_step_cost()
        self.startup_seconds["total"] = time.perf_counter() - self._started
        pending = len(self.runner.layouts) - len(self.runner.ready_buckets)
        logger.info("ready in %.1fs: weights %.1fs, KV cache %.1fs, compilation %.1fs%s",
                    *(self.startup_seconds[k] for k in ("total", "weights", "kv_cache", "compile")),
                    f" ({pending} more step programs compiling in the background)" if pending else "")
        return time.perf_counter() - start

    @property
    def warmup_report(self) -> WarmupReport | None:
        """What warm-up compiled (None until every program is done, and on follower processes)."""
        return self.runner.warmup_report

    @property
    def calibration_due(self) -> bool:
        return self.timing.due

    def calibrate_step_cost(self, max_buckets: int | None = None) -> None:
        """Time idle steps for the step-time model (`StepTiming.calibrate`), unless a request is running."""
        if not self.has_unfinished():
            self.timing.calibrate(max_buckets)

    @property
    def compilations_since_warmup(self) -> int:
        """Programs steps compiled after warm-up (every one, for an engine never warmed up: LLM(warmup=False))."""
        return self.compile_events.lowered - (self.compilations_at_warmup or 0)

    def call(self, work: Callable[[], T], on_follower: T = None) -> T:
        """Run one call of this engine's caller (an `LLM.generate`). In a multi-host run the other processes
        run its device steps meanwhile and get `on_follower`; in a single process this is `work()`."""
        return self.runner.call(work, on_follower)

    def release(self) -> None:
        """The caller is done stepping (a server shutting down): multi-host, the other processes return."""
        self.runner.release()

    # ---- requests -----------------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise ValueError naming the parameter; allocates nothing."""
        if self.runner_type == "pooling":
            raise WrongRunner("this model runs with the pooling runner (embeddings): it does not generate; "
                              "start it with --runner generate for completions")
        suppressed = self.tracker.suppressed_ids(params) if isinstance(params, SamplingParams) else ()
        validate_request(prompt_ids, params, model=self.model_config, scheduler=self.scheduler_config,
                         sampler=self.sampler_config, suppressed_ids=suppressed, grammars=self.grammars)
        validate_priority(priority, self.scheduler_config)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """Check and queue a request (`check_request`, then `submit`). Returns the id."""
        return self.submit(self.check_request(prompt_ids, params, priority, lora_request), request_id, prompt)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams, priority: int = 0,
                      lora_request: LoRARequest | None = None, images: Sequence = ()) -> CheckedRequest:
        """Validate a request (a ValueError naming the parameter) and read its adapter (a `LoRAError`, a
        ValueError, when it cannot be served); allocates nothing. `priority` (only with the priority
        scheduling policy): lower runs first. `images`: the prompt's (`multimodal.prompt.PromptImage`s)."""
        prompt_ids = [int(t) for t in prompt_ids]
        self.validate(prompt_ids, params, priority)
        return self.images.attach(CheckedRequest(prompt_ids, params, priority, self.resolve_lora(lora_request)), images)

    def submit(self, request: CheckedRequest, request_id: str | None = None, prompt: str | None = None) -> str:
        """Queue a checked request as it is (thread-safe): its n choices come out as RequestOutputs with
        `index` 0..n-1 under this one id. Returns the id."""
        request_id = request_id or uuid.uuid4().hex
        self._inbox.put(("add", self.tracker.new_choices(
            request.prompt_ids, request.params, request_id, prompt, request.priority, request.lora, request.images,
            request.mrope)))
        return request_id

    def resolve_lora(self, lora_request: LoRARequest | None):
        """The adapter a request runs under, read and checked (None: the base model)."""
        return resolve_adapter(self.lora, lora_request)

    def abort(self, request_id: str) -> None:
        """Abort a request, every choice of it (thread-safe); slots and pages are freed at the next step."""
        self._inbox.put(("abort", (request_id, self.step_count)))

    def reset_prefix_cache(self) -> int:
        """Evict every cached page no request is using; returns how many. Call it from the thread that
        steps the engine (or offline), never while another thread is inside `step`."""
        return self.scheduler.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.tracker.has_unfinished() or not self._inbox.empty() or self._in_flight is not None

    def _drain_inbox(self) -> list[RequestOutput]:
        outputs = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return outputs
            if kind == "add":
                self.tracker.add(item)
            else:
                request_id, asked_at_step = item
                aborted = self.tracker.abort(request_id)
                if aborted:
                    self.abort_latencies.append(self.step_count - asked_at_step)
                outputs.extend(aborted)

    # ---- the iteration ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.step_count += 1
        outputs = self._drain_inbox()
        speculator = self.speculator
        drafting = speculator is not None and speculator.wants_draws_first(self.scheduler.running)
        read_first = self._in_flight is not None and (self._in_flight.step.prefill_only
                                                      or self.scheduler.waits_for_draws() or drafting)
        if read_first:
            # Read the step in flight before planning the next one, in two cases (the device idles for the
            # planning meanwhile):
            # - It only prefills. Requests arrive in bursts spread over milliseconds (a client's wave, or
            #   a batch job starting), and the first of them finds the engine idle and starts a step alone.
            #   Planned at once, the next step would hold only that request's first decode, and the rest
            #   of the burst would wait for two steps, one of them a prefill. Planned after it, the next
            #   step takes them all; and no decode waits on the planning, since none is running.
            # - A sequence's next span depends on its pending draw: a constrained sequence's next mask
            #   needs the token (unconstrained traffic alone never takes this path), and a step that is to
            #   draft needs its sequences' newest tokens to draft from (speculative decoding, where drafting
            #   is estimated to pay: jaxserve/speculative/payoff.py).
            outputs.extend(self._read(self._in_flight))
            self._in_flight = None
            outputs.extend(self._drain_inbox())
        # Standing by, the speculator sits out a step's planning unless it read first anyway (tokens for free).
        proposing = speculator is not None and (read_first or not speculator.standing_by)
        if proposing:
            speculator.propose(self.scheduler.running, read_first)
        plan = self.scheduler.schedule(self.runner.step_token_limit)  # lower while programs still compile
        launched = None
        if not plan.empty:
            launched = self.runner.launch(plan, masks=self.tracker.grammar_masks(plan))
            if proposing:
                speculator.observe(launched, self.scheduler.running)
            self.stats.count_step(plan)
        # While the device runs the step just launched, advance requests by the one before it.
        if self._in_flight is not None:
            outputs.extend(self._read(self._in_flight))
        self._in_flight = launched
        if speculator is not None:  # while the device runs the step
            speculator.after_step(self.scheduler.running, read_first, launched, self.stats)
        return outputs

    def _read(self, launched: LaunchedStep) -> list[RequestOutput]:
        result = launched.read()
        self.timing.measure(launched)
        return self.runner.head.update(self.tracker, launched.step, result)


def serve_as_follower(args: EngineArgs) -> bool:
    """Multi-host, on a process other than 0: build the engine, run process 0's device steps until it shuts
    down, and return True. On process 0 and in a single-process run, return False at once (the caller
    serves)."""
    if not multihost.initialize(args.distributed_coordinator, args.num_processes, args.process_id) \
            or multihost.is_leader():
        return False
    engine = Engine(args)
    engine.warmup()
    engine.call(lambda: None)  # the server's lifetime on process 0
    return True
