"""Cold and warm start of `jaxserve serve` beside llama.cpp's `llama-server` on the same model, same run.

For each server: seconds from process start to the first `/health` 200, peak resident memory while
starting (VmHWM, which counts memory-mapped checkpoint pages as well as anonymous memory) and resident
memory once serving (VmRSS after a short load of 16 concurrent requests, so the KV cache and the step
programs are in use). jaxserve runs twice: first with an empty persistent compilation cache, then a
restart on the cache the first start wrote; it reports ready before its warm-up has compiled every
step program (`--warmup background`), so the time until all are compiled is shown too. Then the same
two starts from the model converted once by `jaxserve convert --format mapped` (the model's own layout,
64-byte aligned, used in place from the page cache): the counterpart of llama-server's GGUF file.
Checkpoint files are read right before each start, so every server loads from the page cache.

With `--quantization int8` every jaxserve start asks for int8 linear layers: quantized at each load from
the Hugging Face directory, or stored so by `jaxserve convert --quantization int8` in the mapped copy;
pass llama.cpp's Q8_0 file as `--gguf` for the matching llama-server.

The default model is the random 1.1B Llama (Llama-3.2-1B shape, vocab 32000, float32, 4.4 GB in three
shards), built on first use with the peers kit (`make_llama110m.py --size 1b`, then its GGUF with
`convert_models.sh`). Needs `../shared/peers/setup.sh` to have run once.

    ./dev run python benchmarks/cold_start.py [--model DIR --gguf FILE] [--repeats 2] [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_KIT = ROOT.parent / "shared" / "peers"
PEERS_ROOT = Path(os.environ.get("PEERS_ROOT", Path.home() / ".cache" / "jaxserve-peers"))
DEFAULT_MODEL = PEERS_ROOT / "models" / "llama1b-random"
DEFAULT_GGUF = PEERS_ROOT / "models" / "gguf" / "llama1b-random-f32.gguf"
SETTLE_SECONDS = 5


def ensure_model(model: Path, gguf: Path) -> None:
    """Build the random 1.1B model and its GGUF with the peers kit when they are missing."""
    python = PEERS_ROOT / "venv" / "bin" / "python"
    if not model.is_dir():
        print(f"building {model} with the peers kit (a few minutes)", file=sys.stderr)
        subprocess.run([python, PEERS_KIT / "make_llama110m.py", "--size", "1b", "--out", model], check=True)
    if not gguf.is_file():
        subprocess.run(["bash", PEERS_KIT / "convert_models.sh"], check=True,
                       env=dict(os.environ, PEERS_ROOT=str(PEERS_ROOT), PY=str(python)))


def ensure_mapped(model: Path, quantization: str | None = None) -> Path:
    """The model converted to jaxserve's mapped format (its linear layers quantized as asked), beside it
    (built once, like the GGUF)."""
    mapped = model.with_name(model.name + "-mapped" + (f"-{quantization}" if quantization else ""))
    if not (mapped / "jaxserve_checkpoint.json").is_file():
        shutil.rmtree(mapped, ignore_errors=True)
        print(f"converting {model} to {mapped} (jaxserve convert --format mapped)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "jaxserve", "convert", "--model", str(model), "--output",
                        str(mapped), "--format", "mapped", "--dtype", "float32",
                        *(["--quantization", quantization] if quantization else [])], check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return mapped


def read_into_page_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def proc_status(pid: int, key: str) -> int:
    """A /proc/PID/status memory field in bytes (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def complete(base_url: str, model: str, max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": "Once upon a time there was a little robot who",
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.load(r)


def measure_start(name: str, command: list[str], port: int, log: Path, served_model: str, checkpoint: list[Path],
                  env: dict | None = None, timeout: float = 900) -> dict:
    """Start a server, time it to /health 200 (and to every program compiled), load it briefly, read its
    memory, stop it."""
    base_url = f"http://127.0.0.1:{port}"
    # This VM hands freed memory back to its host after ~2 s (free page reporting), and touching fresh
    # memory then costs a host fault per page: let every start find the machine in that same state.
    time.sleep(SETTLE_SECONDS)
    read_into_page_cache(checkpoint)  # the kernel may have paged out cold file pages meanwhile
    with open(log, "w") as out:
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while not healthy(base_url):
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited with {proc.returncode}; see {log}")
                if time.perf_counter() - started > timeout:
                    raise SystemExit(f"{name} not ready after {timeout:.0f} s; see {log}")
                time.sleep(0.05)
            ready = time.perf_counter() - started
            all_programs = wait_for_all_programs(base_url, started, timeout) if name.startswith("jaxserve") else ready
            peak_starting = proc_status(proc.pid, "VmHWM")
            with ThreadPoolExecutor(16) as pool:  # every slot busy once: KV cache and step programs in use
                list(pool.map(lambda _: complete(base_url, served_model, 16), range(16)))
            serving = proc_status(proc.pid, "VmRSS")
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"server": name, "ready_s": ready, "all_programs_s": all_programs, "peak_rss_starting": peak_starting,
            "rss_serving": serving, "log": str(log)}


def wait_for_all_programs(base_url: str, started: float, timeout: float) -> float:
    """Seconds from process start until /metrics says every step program is compiled (jaxserve's
    background warm-up goes on after /health turns 200)."""
    while time.perf_counter() - started < timeout:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        if 'jaxserve:startup_seconds{phase="all_programs"}' in text:
            return time.perf_counter() - started
        time.sleep(0.1)
    raise SystemExit(f"step programs still compiling after {timeout:.0f} s")


def startup_report(log: Path) -> dict:
    """The figures of jaxserve's startup report lines (weights GB/s, compiled programs, cache hits)."""
    text = log.read_text(errors="replace")
    report = {}
    if m := re.search(r"weights: .*? in ([\d.]+)s \(([\d.]+) GB/s\)", text):
        report["weights_s"], report["weights_gb_s"] = float(m.group(1)), float(m.group(2))
    if m := re.search(r"compiled (\d+) step programs .*?, (\d+) from the persistent compilation cache", text):
        report["programs"], report["cache_hits"] = int(m.group(1)), int(m.group(2))
    if m := re.search(r"ready in ([\d.]+)s: weights ([\d.]+)s, KV cache ([\d.]+)s, compilation ([\d.]+)s", text):
        report.update(zip(("total_s", "weights_phase_s", "kv_cache_s", "compile_s"), map(float, m.groups())))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="Hugging Face model directory")
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the same model as GGUF, for llama-server")
    ap.add_argument("--llama-server", type=Path, default=PEERS_ROOT / "build-native" / "bin" / "llama-server")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of (llama-server, jaxserve cold, jaxserve warm)")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--out", type=Path, default=None, help="append one JSON line per start here")
    ap.add_argument("--no-mapped", dest="mapped", action="store_false",
                    help="skip the starts from the model converted to the mapped format")
    ap.add_argument("--quantization", choices=["int8", "fp8"], default=None,
                    help="int8 / fp8 linear layers: quantized at load from --model, stored so in the mapped copy")
    args = ap.parse_args()

    if args.model == DEFAULT_MODEL or args.gguf == DEFAULT_GGUF:
        ensure_model(args.model, args.gguf)
    sources = {"jaxserve": args.model} | ({"jaxserve mapped": ensure_mapped(args.model, args.quantization)}
                                          if args.mapped else {})
    logs = Path(tempfile.mkdtemp(prefix="cold_start-"))
    threads = str(os.cpu_count())
    llama = [str(args.llama_server), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(args.port),
             "-c", str(args.max_num_seqs * args.max_model_len), "--parallel", str(args.max_num_seqs),
             "--cont-batching", "-t", threads, "-tb", threads]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    kinds = ["llama-server"] + [f"{source} {start}" for source in sources for start in ("first start", "restart")]
    rows = []
    for round_ in range(args.repeats):
        rows.append(measure_start("llama-server", llama, args.port, logs / f"llama-server-{round_}.log", "model",
                                  [args.gguf]))
        for source, model in sources.items():
            cache = Path(tempfile.mkdtemp(prefix="xla-cache-"))
            jaxserve = [sys.executable, "-m", "jaxserve", "serve", "--model", str(model), "--served-model-name",
                        args.model.name, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
                        str(args.max_model_len), "--port", str(args.port), "--compilation-cache-dir", str(cache),
                        *(["--quantization", args.quantization] if args.quantization and model == args.model else [])]
            for kind in (f"{source} first start", f"{source} restart"):
                log = logs / f"{kind.replace(' ', '-')}-{round_}.log"
                row = measure_start(kind, jaxserve, args.port, log, args.model.name,
                                    sorted(model.glob("*.safetensors")), env=env)
                rows.append(row | startup_report(log))
            shutil.rmtree(cache, ignore_errors=True)
        for row in rows[-len(kinds):]:
            print(json.dumps(row | {"round": round_, "model": str(args.model)}), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row | {"round": round_, "model": str(args.model)}) + "\n")

    def median(kind: str, key: str) -> float:
        values = sorted(r[key] for r in rows if r["server"] == kind and key in r)
        return values[len(values) // 2] if values else float("nan")

    base = median("llama-server", "ready_s")
    print(f"\n{args.model.name}{f', {args.quantization} linear layers' if args.quantization else ''}, "
          f"--max-num-seqs {args.max_num_seqs} --max-model-len {args.max_model_len}, "
          f"{os.cpu_count()} cores, median of {args.repeats} round(s); logs in {logs}")
    print("\n| | /health 200 (s) | x llama-server | all programs (s) | peak RSS starting (GB) | RSS serving (GB) "
          "| peak / serving | weights GB/s | programs (cache hits) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for kind in kinds:
        ready, every, peak, serving = (median(kind, k) for k in
                                       ("ready_s", "all_programs_s", "peak_rss_starting", "rss_serving"))
        weights = median(kind, "weights_gb_s")
        programs = f"{median(kind, 'programs'):.0f} ({median(kind, 'cache_hits'):.0f})" if kind != "llama-server" else ""
        print(f"| {kind} | {ready:.1f} | {ready / base:.1f}x | {every:.1f} | {peak / 1e9:.2f} | {serving / 1e9:.2f} | "
              f"{peak / serving:.2f}x | {'' if weights != weights else f'{weights:.2f}'} | {programs} |")


if __name__ == "__main__":
    main()
