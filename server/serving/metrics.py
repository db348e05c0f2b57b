"""Prometheus metrics under the `jaxserve:` prefix, each also under vLLM's `vllm:` name, in a registry per app
(tests build several apps).

1. The engine client (server/serving/engine_client.py) feeds the latency histograms and token counters
   through this class's methods as tokens reach the client (`count_prompt` as a request is queued,
   `count_generated` per output, `observe_request` once it ends, with the queue time the engine
   measured); nothing else changes them. State gauges
   (running, waiting, KV usage) and engine-owned counters (compilations since warm-up, preemptions,
   prefix-cache queries and hits in tokens, steps and the sequences and tokens they held) are read from
   the engine at scrape time, so they never drift from the truth.
2. One collector reads every family once per scrape and yields it twice: as ours, and renamed to the
   vLLM series that dashboards built for vLLM read (`vllm:num_requests_running`,
   `vllm:time_to_first_token_seconds`, ...), with vLLM's `model_name` and `engine` labels. Both come
   from the same read, so a scrape shows the same values and the same buckets under both names, and
   nothing is counted twice.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jaxserve.entrypoints.async_engine import AsyncEngine, TokenTimer
from jaxserve.speculative.payoff import OUTCOMES

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
# Phases of a whole request (queued, prefilling, decoding): vLLM's request-latency buckets.
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 5e6

# Our family -> the vLLM names that carry the same series (vLLM renamed some; dashboards read either).
VLLM_NAMES = {
    "jaxserve:num_requests_running": ("vllm:num_requests_running",),
    "jaxserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "jaxserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "jaxserve:num_preemptions": ("vllm:num_preemptions",),
    "jaxserve:lora_requests_info": ("vllm:lora_requests_info",),
    "jaxserve:prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "jaxserve:prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "jaxserve:prompt_tokens": ("vllm:prompt_tokens",),
    "jaxserve:generation_tokens": ("vllm:generation_tokens",),
    "jaxserve:request_success": ("vllm:request_success",),
    "jaxserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "jaxserve:inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                             "vllm:time_per_output_token_seconds"),
    "jaxserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "jaxserve:request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "jaxserve:request_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    "jaxserve:request_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "jaxserve:request_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "jaxserve:request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "jaxserve:request_generation_tokens": ("vllm:request_generation_tokens",),
    "jaxserve:spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "jaxserve:spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "jaxserve:spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "jaxserve:spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}


def _engine_state(async_engine: AsyncEngine):
    engine = async_engine.engine
    ready = engine is not None and async_engine.ready.is_set()
    scheduler = engine.scheduler if ready else None
    running = GaugeMetricFamily("jaxserve:num_requests_running", "Requests holding a decode slot")
    waiting = GaugeMetricFamily("jaxserve:num_requests_waiting", "Requests queued for a slot or pages")
    usage = GaugeMetricFamily("jaxserve:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full)")
    compiles = CounterMetricFamily("jaxserve:compilations", "XLA compilations since warm-up ended")
    preemptions = CounterMetricFamily("jaxserve:num_preemptions", "Requests preempted for KV pages")
    queries = CounterMetricFamily("jaxserve:prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache (at each admission)")
    hits = CounterMetricFamily("jaxserve:prefix_cache_hits", "Prompt tokens whose KV pages came from the prefix cache")
    steps = CounterMetricFamily("jaxserve:engine_steps", "Device steps the engine launched")
    step_sequences = CounterMetricFamily("jaxserve:engine_step_sequences",
                                         "Sequences the steps held (per step: the batch size)")
    step_tokens = CounterMetricFamily("jaxserve:engine_step_tokens",
                                      "Tokens the steps held, prompt and decode, padding excluded")
    running.add_metric([], len(scheduler.running) if scheduler else 0)
    waiting.add_metric([], len(scheduler.waiting) if scheduler else 0)
    usage.add_metric([], scheduler.kv_usage() if scheduler else 0.0)
    compiles.add_metric([], engine.compilations_since_warmup if ready else 0)
    preemptions.add_metric([], scheduler.num_preemptions if scheduler else 0)
    queries.add_metric([], scheduler.prefix_cache_queries if scheduler else 0)
    hits.add_metric([], scheduler.prefix_cache_hits if scheduler else 0)
    stats = engine.stats if ready else None
    steps.add_metric([], stats.steps if stats else 0)
    step_sequences.add_metric([], stats.step_sequences if stats else 0)
    step_tokens.add_metric([], stats.step_tokens if stats else 0)
    startup = GaugeMetricFamily("jaxserve:startup_seconds", "Seconds each start-up phase took (total: to ready)",
                                labels=["phase"])
    for phase, seconds in (engine.startup_seconds.items() if ready else ()):
        startup.add_metric([phase], seconds)
    programs = GaugeMetricFamily("jaxserve:step_programs", "Step programs (one per token bucket): ready to "
                                 "run, and in all (warm-up may compile some while serving)", labels=["state"])
    if ready:
        programs.add_metric(["ready"], len(engine.runner.ready_buckets))
        programs.add_metric(["total"], len(engine.runner.layouts))
    precision = GaugeMetricFamily("jaxserve:model_precision_info", "What the weights and the KV cache are stored "
                                  "in (1 per part): dtype, and for quantized linear layers their codes and "
                                  "strategy", labels=["part", "dtype", "strategy"])
    memory = GaugeMetricFamily("jaxserve:model_memory_bytes", "Bytes on the devices: weights (4-bit codes at half "
                               "a byte) and the KV cache (pages and scales)", labels=["part"])
    if ready:
        p = engine.precision
        precision.add_metric(["weights", p.weights, "float"], 1)
        if p.linear_codes:
            precision.add_metric(["linear_layers", p.linear_codes, p.linear_strategy], 1)
        precision.add_metric(["kv_cache", p.kv_cache, "per_token_scales" if p.kv_cache in ("int8", "float8_e4m3fn")
                              else "float"], 1)
        memory.add_metric(["weights"], p.weight_bytes)
        memory.add_metric(["kv_cache"], p.kv_cache_bytes)
    return (running, waiting, usage, compiles, preemptions, queries, hits, steps, step_sequences, step_tokens,
            startup, programs, precision, memory, *_lora_info(engine if ready else None),
            *(_spec_decode_state(engine) if ready and engine.speculator is not None else ()))


def _lora_info(engine) -> tuple:
    """vLLM's LoRA gauge: the adapters of running and waiting requests as labels, the scrape time as value
    (no sample without LoRA)."""
    info = GaugeMetricFamily("jaxserve:lora_requests_info", "LoRA adapters of the running and waiting requests",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    if engine is None or engine.lora is None:
        return (info,)

    def names(requests) -> str:
        return ",".join(sorted({r.lora.request.lora_name for r in requests if r.lora is not None}))

    scheduler = engine.scheduler
    info.add_metric([str(engine.lora.config.max_loras), names(scheduler.running), names(list(scheduler.waiting))],
                    time.time())
    return (info,)


def _spec_decode_state(engine):
    """Speculative decoding's counters (only when it is configured, as vLLM shows them)."""
    stats, speculator = engine.stats, engine.speculator
    families = []
    for name, doc, value in (
            ("num_drafts", "Sequences that verified draft tokens, once per step", stats.spec_drafts),
            ("num_draft_tokens", "Draft tokens verified", stats.spec_draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted", stats.spec_accepted_tokens)):
        family = CounterMetricFamily(f"jaxserve:spec_decode_{name}", doc)
        family.add_metric([], value)
        families.append(family)
    per_pos = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position of the drafts", labels=["position"])
    for position in range(speculator.num_speculative_tokens):
        accepted = stats.spec_accepted_per_pos
        per_pos.add_metric([str(position)], accepted[position] if position < len(accepted) else 0)
    host = CounterMetricFamily("jaxserve:spec_decode_proposer_seconds", "Host seconds the proposer took: "
                               "on the step's critical path (propose) and overlapped with the device (prepare)",
                               labels=["phase"])
    host.add_metric(["propose"], speculator.propose_seconds)
    host.add_metric(["prepare"], speculator.prepare_seconds)
    steps = CounterMetricFamily("jaxserve:spec_decode_steps", "Engine steps by what drafting did: drafting, probe "
                                "(drafting to measure again where it does not pay), or why it was off "
                                "(unprofitable, no_drafts, measuring, batch_size)", labels=["outcome"])
    for outcome in OUTCOMES:
        steps.add_metric([outcome], speculator.outcomes[outcome])
    return (*families, per_pos, host, steps)


class _Exporter:
    """The registry's one collector: every family once, then its vLLM twins (see the module docstring)."""

    def __init__(self, async_engine: AsyncEngine, own: list):
        self.async_engine = async_engine
        self.own = own  # our client-side metrics (histograms, counters), registered nowhere else

    def collect(self):
        engine = self.async_engine.engine
        model_name = engine.model_name if engine is not None and self.async_engine.ready.is_set() else None
        families = [*_engine_state(self.async_engine), *(f for metric in self.own for f in metric.collect())]
        yield from families
        if model_name is None:
            return
        labels = {"model_name": model_name, "engine": "0"}
        for family in families:
            for name in VLLM_NAMES.get(family.name, ()):
                twin = Metric(name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    twin.add_sample(name + s.name[len(family.name):], {**s.labels, **labels}, s.value,
                                    s.timestamp, s.exemplar)
                yield twin


# Histogram -> (our name, help, buckets); `observe_request` feeds them (attributes `_ttft`, `_itl`, ...).
_HISTOGRAMS = {
    "ttft": ("jaxserve:time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS),
    "itl": ("jaxserve:inter_token_latency_seconds", "Time between tokens of a request", LATENCY_BUCKETS),
    "e2e": ("jaxserve:e2e_request_latency_seconds", "Request latency, arrival to finish", LATENCY_BUCKETS),
    "queue": ("jaxserve:request_queue_time_seconds", "Time waiting for a slot and KV pages, arrival to first "
              "admission", REQUEST_BUCKETS),
    "prefill": ("jaxserve:request_prefill_time_seconds", "Time from admission to the first token", REQUEST_BUCKETS),
    "decode": ("jaxserve:request_decode_time_seconds", "Time from the first token to the last", REQUEST_BUCKETS),
    "inference": ("jaxserve:request_inference_time_seconds", "Time from admission to the last token",
                  REQUEST_BUCKETS),
    "prompt_lengths": ("jaxserve:request_prompt_tokens", "Prompt tokens per finished request", TOKEN_COUNT_BUCKETS),
    "output_lengths": ("jaxserve:request_generation_tokens", "Generated tokens per finished request",
                       TOKEN_COUNT_BUCKETS),
}


class Metrics:
    def __init__(self, async_engine: AsyncEngine):
        for attribute, (name, doc, buckets) in _HISTOGRAMS.items():
            setattr(self, f"_{attribute}", Histogram(name, doc, registry=None, buckets=buckets))
        self._prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of admitted requests", registry=None)
        self._generation_tokens = Counter("jaxserve:generation_tokens", "Tokens generated", registry=None)
        self._requests = Counter("jaxserve:request_success", "Finished requests by finish reason",
                                 ["finished_reason"], registry=None)
        self.registry = CollectorRegistry()
        self.registry.register(_Exporter(async_engine, [
            *(getattr(self, f"_{attribute}") for attribute in _HISTOGRAMS),
            self._prompt_tokens, self._generation_tokens, self._requests]))

    def count_prompt(self, tokens: int) -> None:
        """A request's prompt, as it is queued."""
        self._prompt_tokens.inc(tokens)

    def count_generated(self, tokens: int) -> None:
        self._generation_tokens.inc(tokens)

    def observe_request(self, timer: TokenTimer, out) -> None:
        """A request (one choice) has finished with output `out`: its latencies and lengths."""
        if timer.first_token is not None:
            self._ttft.observe(timer.first_token)
        for gap in timer.gaps:
            self._itl.observe(gap)
        self._e2e.observe(timer.total)
        self._requests.labels(finished_reason=out.finish_reason or "unknown").inc()
        self._prompt_lengths.observe(len(out.prompt_token_ids))
        self._output_lengths.observe(out.num_output_tokens)
        if out.queue_seconds is None:  # never admitted (aborted while queued)
            self._queue.observe(timer.total)
            return
        self._queue.observe(out.queue_seconds)
        if timer.first_token is not None:
            last = timer.last - timer.start
            self._prefill.observe(max(0.0, timer.first_token - out.queue_seconds))
            self._decode.observe(last - timer.first_token)
            self._inference.observe(max(0.0, last - out.queue_seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)
