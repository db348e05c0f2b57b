"""`jaxserve bench serve`: load any OpenAI-compatible server and report what its users feel.

Metric definitions are vLLM's (`vllm bench serve`), so numbers compare across tools:
- TTFT: from sending a request to the first chunk that carries text.
- ITL: the gaps between consecutive chunks that carry text (all requests pooled).
- E2EL: from sending a request to its last chunk with text.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- Throughput: successful requests, output tokens, and prompt + output tokens, each over the wall time.
- Goodput: requests per second that met every SLO given with `--goodput` (TTFT, TPOT, E2EL in ms).
Output tokens come from the server's `usage` (asked for with `stream_options.include_usage`); a server
that sends none is counted by chunks with text. Percentiles interpolate linearly (numpy's default).

Load: requests arrive at `--request-rate` per second (inf: all at once), gaps drawn from a gamma
distribution of shape `--burstiness` (1: Poisson); `--max-concurrency` caps how many are in flight.
A comma list in either runs a sweep, one level after another, on the same requests. Before each level,
`--num-warmups` untimed requests (default 1) go out one at a time on that level's connections.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time

import numpy as np

from jaxserve.bench.datasets import SampleRequest


class ServerUnreachable(ConnectionError):
    """The base URL does not answer: a clear message instead of a traceback (the CLI reports OSErrors)."""


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)


def request_body(sample: SampleRequest, model: str, chat: bool, temperature: float, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": sample.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = sample.messages or [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and llama-server's extension: every request runs its full length
    return body


async def send(client, url: str, body: dict, chat: bool) -> RequestResult:
    """One streaming request, timed chunk by chunk. A kept-alive connection the server closed while idle
    (llama-server does) fails before any response: the request is then sent once more, timed afresh."""
    import httpx

    for attempt in range(2):
        try:
            return await _timed_stream(client, url, body, chat)
        except httpx.RemoteProtocolError as e:
            if attempt or "without sending a response" not in str(e):
                return RequestResult(error=f"{type(e).__name__}: {e}")
        except httpx.HTTPError as e:
            return RequestResult(error=f"{type(e).__name__}: {e}")


async def _timed_stream(client, url: str, body: dict, chat: bool) -> RequestResult:
    result, chunks = RequestResult(), 0
    start = last = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            for choice in data.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
            if data.get("usage"):
                result.prompt_tokens = data["usage"].get("prompt_tokens") or 0
                result.output_tokens = data["usage"].get("completion_tokens") or 0
    if chunks == 0:
        result.error = "no chunk carried text"
        return result
    result.e2el, result.success = last - start, True
    result.output_tokens = result.output_tokens or chunks
    return result


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    if math.isinf(rate):
        return np.zeros(n)
    # Mean gap 1 / rate; shape 1 is a Poisson process, smaller is burstier (vLLM's definition).
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)


async def run_level(base_url: str, model: str, requests: list[SampleRequest], *, chat: bool, rate: float,
                    burstiness: float, max_concurrency: int | None, temperature: float, ignore_eos: bool,
                    seed: int, progress: bool = True, warmups: list[SampleRequest] = ()
                    ) -> tuple[list[RequestResult], float]:
    """Send `requests` at the given rate and concurrency; return each one's result and the wall time.
    `warmups` go first, one at a time and untimed, on the same connection pool: the level then starts with
    a connection open, as a client that has been talking to the server does, and a server's
    first-request costs stay out of its numbers."""
    import httpx
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    gaps = _arrival_gaps(len(requests), rate, burstiness, seed)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    connections = httpx.Limits(max_connections=(max_concurrency or len(requests)) + 1)

    async with httpx.AsyncClient(limits=connections, timeout=httpx.Timeout(None, connect=10), trust_env=False) as client:
        async def one(sample: SampleRequest) -> RequestResult:
            async with limit:
                result = await send(client, url, request_body(sample, model, chat, temperature, ignore_eos), chat)
            bar.update()
            return result

        for sample in warmups:
            warm = await send(client, url, request_body(sample, model, chat, temperature, ignore_eos), chat)
            if not warm.success:
                raise ServerUnreachable(f"the warm-up request failed: {warm.error}")
        start = time.perf_counter()
        tasks = []
        for sample, gap in zip(requests, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(sample)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def _stats(values_s: list[float], percentiles: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "median": None, "std": None, **{f"p{p:g}": None for p in percentiles}}
    ms = np.asarray(values_s) * 1000.0
    out = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    out.update({f"p{p:g}": float(np.percentile(ms, p)) for p in percentiles})
    return out


def summarize(results: list[RequestResult], duration: float, percentiles: list[float],
              goodput: dict[str, float] | None = None) -> dict:
    ok = [r for r in results if r.success]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [gap for r in ok for gap in r.itl]
    prompt_tokens, output_tokens = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    summary = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in ok], percentiles), "tpot_ms": _stats(tpot, percentiles),
        "itl_ms": _stats(itl, percentiles), "e2el_ms": _stats([r.e2el for r in ok], percentiles),
        # Per-request values, for CDFs and for anyone who wants to recompute.
        "ttfts_ms": [r.ttft * 1000 for r in ok], "e2els_ms": [r.e2el * 1000 for r in ok],
        "itls_ms": [g * 1000 for g in itl], "output_lens": [r.output_tokens for r in ok],
    }
    if goodput:
        def good(r: RequestResult) -> bool:
            per_token = (r.e2el - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            measured = {"ttft": r.ttft, "tpot": per_token, "e2el": r.e2el}
            return all(measured[k] * 1000 <= limit for k, limit in goodput.items())
        summary["goodput"] = sum(map(good, ok)) / duration
        summary["goodput_slos_ms"] = goodput
    return summary


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos[name] = float(value)
    return slos


def served_model(base_url: str) -> str:
    """The first model the server lists; also the check that it answers at all."""
    import httpx
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10, trust_env=False)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {base_url}: {e}") from None
    if response.status_code != 200:
        raise ServerUnreachable(f"{base_url}/v1/models answered HTTP {response.status_code}")
    models = response.json().get("data") or []
    if not models:
        raise ServerUnreachable(f"{base_url} serves no model")
    return models[0]["id"]


def table(levels: list[dict]) -> str:
    """One row per level: the figures people compare."""
    lines = ["| concurrency | rate | ok | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms "
             "| E2EL p50 ms |", "|---:|---:|---:|---:|---:|---|---:|---|---:|"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"
    for level in levels:
        s = level["metrics"]
        lines.append(
            f"| {level['max_concurrency'] or 'inf'} | {level['request_rate']} | {s['completed']}/{s['completed'] + s['failed']} "
            f"| {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {f(s['ttft_ms']['median'])} / "
            f"{f(s['ttft_ms'].get('p99'))} | {f(s['tpot_ms']['median'])} | {f(s['itl_ms']['median'])} / "
            f"{f(s['itl_ms'].get('p99'))} | {f(s['e2el_ms']['median'])} |")
    return "\n".join(lines)
