"""Prometheus metrics under the `jaxserve:` prefix, in a registry per app (tests build several apps).

Latency histograms and token counters are fed by the request handlers as tokens reach the client;
state gauges (running, waiting, KV usage) and engine-owned counters (compilations since warm-up,
preemptions, prefix-cache queries and hits in tokens, steps and the sequences and tokens they held)
are read from the engine at scrape time, so they never drift from the truth.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.async_engine import AsyncEngine, TokenTimer

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class _EngineStateCollector:
    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine

    def collect(self):
        engine = self.async_engine.engine
        ready = engine is not None and self.async_engine.ready.is_set()
        scheduler = engine.scheduler if ready else None
        running = GaugeMetricFamily("jaxserve:num_requests_running", "Requests holding a decode slot")
        waiting = GaugeMetricFamily("jaxserve:num_requests_waiting", "Requests queued for a slot or pages")
        usage = GaugeMetricFamily("jaxserve:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full)")
        compiles = CounterMetricFamily("jaxserve:compilations", "XLA compilations since warm-up ended")
        preemptions = CounterMetricFamily("jaxserve:num_preemptions", "Requests preempted for KV pages")
        queries = CounterMetricFamily("jaxserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (at each admission)")
        hits = CounterMetricFamily("jaxserve:prefix_cache_hits",
                                   "Prompt tokens whose KV pages came from the prefix cache")
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
        yield from (running, waiting, usage, compiles, preemptions, queries, hits, steps, step_sequences, step_tokens,
                    startup, programs)


class Metrics:
    def __init__(self, async_engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("jaxserve:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("jaxserve:inter_token_latency_seconds", "Time between tokens of a request",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("jaxserve:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("jaxserve:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        r.register(_EngineStateCollector(async_engine))

    def observe_request(self, timer: TokenTimer, finish_reason: str | None) -> None:
        if timer.first_token is not None:
            self.ttft.observe(timer.first_token)
        for gap in timer.gaps:
            self.itl.observe(gap)
        self.e2e.observe(timer.total)
        self.requests.labels(finished_reason=finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
