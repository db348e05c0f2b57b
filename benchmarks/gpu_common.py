"""The run state and helpers that both parts of the GPU script (`gpu_kernels.py`, sections 1-4 and main();
`gpu_engine_section.py` and `gpu_engine_step.py`, section 5) share.

1. `gpu_kernels.main()` sets the run state from the command line: INTERPRET (--interpret), TIMING (one call
   each when interpreting), BUDGET (--time-budget), and empties COPY. Read it as `gpu_common.INTERPRET` etc.:
   a `from gpu_common import INTERPRET` would keep the value of import time.
2. Every timed part runs through `guarded`, which checks the budget first (`check_budget`) and turns any
   exception into an error row, so one broken configuration never hides the others' numbers.
3. `bench` times a jitted call (warm-up, then the median over repeats of back-to-back calls);
   `measure_copy` times the device-to-device copy whose GB/s (kept in COPY) every later ratio divides by.
4. `record_check` turns a kernel output and its reference into a pass/fail check row, printed as it goes.
5. `profile_summary` runs a few calls under `jax.profiler` and sums the trace's events per process and name:
   on a GPU the device's kernels, per step, which is where a step's time goes; `device_share` turns it into
   a row's device busy time, its share of the wall time, and the kernels' own fraction of the copy's speed.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.testing import TOLERANCES

INTERPRET = False  # --interpret: a CPU dry run of this script's logic (use tiny sizes)
TIMING_DEFAULTS = dict(warmup=3, calls=20, repeats=5)
TIMING = dict(TIMING_DEFAULTS)  # --interpret: one call each, only to exercise the code
DTYPE = jnp.bfloat16  # of the timed kernel sections and of the copy yardstick
COPY: dict = {}  # {"gbs": copy bandwidth} once a section measured it (the decode section, or e2e itself)
BUDGET = dict(start=time.perf_counter(), seconds=float("inf"))  # --time-budget: later parts are skipped


def bench(fn, *args, calls: int | None = None) -> float:
    """Median seconds per call over `repeats` runs of `calls` back-to-back calls."""
    calls = min(calls or TIMING["calls"], TIMING["calls"])
    for _ in range(TIMING["warmup"]):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(TIMING["repeats"]):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return float(np.median(times))


def check_budget(reserve: float = 0.0) -> None:
    """Raise once the run is past --time-budget (or would be, for a part expected to take `reserve` seconds):
    the parts not started yet become error rows, and the table and JSON still get written before the device
    call's timeout."""
    elapsed = time.perf_counter() - BUDGET["start"]
    if elapsed + reserve > BUDGET["seconds"]:
        raise TimeoutError(f"skipped: {elapsed:.0f} s in" + (f", needs ~{reserve:.0f} s more" if reserve else "")
                           + f", past --time-budget {BUDGET['seconds']:.0f} s")


def guarded(rows: list, bench_name: str, config: str, measure) -> None:
    """Run `measure() -> dict` into a row; an exception becomes an error row (and a traceback on stderr)."""
    try:
        check_budget()
        rows.append(dict(bench=bench_name, config=config, **measure()))
    except Exception as e:  # keep going: one broken configuration must not hide the others' numbers
        rows.append(dict(bench=bench_name, config=config, error=f"{type(e).__name__}: {e}"[:2000]))
        if not isinstance(e, TimeoutError):
            traceback.print_exc()


def measure_copy(nbytes: int) -> dict:
    """Device-to-device copy of an `nbytes` buffer (read + write counted): the bandwidth yardstick, kept in COPY
    for every later section of the run."""
    buf = jnp.ones((nbytes // jnp.dtype(DTYPE).itemsize,), DTYPE)
    t = bench(jax.jit(jnp.copy), buf)
    COPY["gbs"] = 2 * nbytes / t / 1e9
    print(f"  copy: {COPY['gbs']:.0f} GB/s", flush=True)
    return dict(ms=t * 1e3, gbs=COPY["gbs"], ratio=1.0)


def record_check(results, name, got, want, dtype, padding_zero: bool) -> None:
    atol, rtol = TOLERANCES[dtype]
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ok = bool(np.all(np.abs(g - w) <= atol + rtol * np.abs(w))) and bool(np.isfinite(g).all()) and padding_zero
    err = float(np.max(np.abs(g - w))) if g.size else 0.0
    results.append(dict(check=name, ok=ok, max_abs_err=err, atol=atol, rtol=rtol, padding_zero=padding_zero))
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |err| {err:.2e}"
          + ("" if padding_zero else ", padding rows NOT zero"), flush=True)


def profile_summary(run, calls: int, top: int = 12, wait=None) -> dict:
    """Run `run()` (one step, say) `calls` times under the profiler and sum the trace's complete events by
    process and name. Returns {"wall_ms": per call, "processes": {process: {"busy_ms": per call, "top":
    [[name, ms per call, count per call], ...]}}}; Python frames are left out. On a GPU the device processes'
    events are its kernels and copies (on a stream they do not nest, so busy_ms is the device's time, and
    far below wall_ms means the host keeps the device waiting); host events can nest, so a host process's
    busy_ms overcounts. `wait()`, called after the last `run()`, waits for the device's work (asynchronous
    calls return before it ends), so wall_ms covers it."""
    with tempfile.TemporaryDirectory() as trace_dir:  # not under $OUT: a call returns at most 8 files
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        try:
            start = time.perf_counter()
            for _ in range(calls):
                run()
            if wait is not None:
                wait()
            wall_ms = (time.perf_counter() - start) * 1e3 / calls
        finally:
            jax.profiler.stop_trace()
        (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals, counts = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            where = process.get(e["pid"], str(e["pid"]))
            totals[where][e["name"]] += e.get("dur", 0) / 1e3 / calls
            counts[where][e["name"]] += 1 / calls
    return dict(wall_ms=wall_ms, processes={
        where: dict(busy_ms=sum(t.values()), top=[[name, ms, counts[where][name]] for name, ms in t.most_common(top)])
        for where, t in totals.items()})


def device_process(profile: dict) -> tuple[str, dict] | None:
    """The busiest accelerator process of a profile (its name, summary), or None (a CPU run has none). A GPU
    may show several (streams); the busiest is the one the step's kernels run on."""
    devices = [(where, p) for where, p in profile["processes"].items() if "GPU" in where or "TPU" in where]
    return max(devices, key=lambda d: d[1]["busy_ms"]) if devices else None


def device_share(profile: dict, min_bytes: float, copy_gbs: float) -> dict:
    """A profiled step's row fields: the profile, and where a device ran it, the device's busy time per step,
    its share of the wall time under the profiler (far below 1: the host keeps the device waiting), and the
    step's least bytes over the busy time as a fraction of the copy's speed (the kernels' own pace, with the
    host's gaps taken out)."""
    found = device_process(profile)
    if found is None:
        return dict(profile=profile)
    where, summary = found
    busy_ms = summary["busy_ms"]
    return dict(profile=profile, device=where, device_busy_ms=busy_ms, busy_of_wall=busy_ms / profile["wall_ms"],
                device_ratio=min_bytes / (busy_ms / 1e3) / 1e9 / copy_gbs if busy_ms else float("nan"))


def print_profile(label: str, profile: dict) -> None:
    """The profile's busiest events per process, per step (device processes first: their time is the step's
    device time)."""
    processes = profile["processes"]
    for where in sorted(processes, key=lambda w: ("GPU" not in w and "TPU" not in w, w)):
        summary = processes[where]
        print(f"  profile, {label}, {where}: {summary['busy_ms']:.2f} ms of events per step "
              f"(wall {profile['wall_ms']:.2f} ms per step under the profiler)", flush=True)
        for name, ms, count in summary["top"]:
            print(f"    {ms:8.3f} ms {count:6.1f}x  {name[:90]}", flush=True)
