#!/usr/bin/env bash
# jaxserve under the load of ../shared/peers/side_by_side.sh for the 124.7M model (llama110m-random, prompt
# 128, 64 output tokens, --ignore-eos, --warmup full, --max-num-seqs 16), once per set of serve flags, after
# llama-server on the same load; one JSON line per level in OUT, then a table with ITL p99. Used to compare
# scheduler knobs (docs/performance.md, "Bursts of arrivals"). From the project root:
#   [CONC=4,16] benchmarks/serve_flag_variants.sh OUT.jsonl "" "--waiting-served-ratio 0" ...
set -u
OUT=$1; shift; : > "$OUT"
PR=$HOME/.cache/jaxserve-peers; PP=$PR/venv/bin/python; M110=$PR/models/llama110m-random
LOAD="$(dirname "$0")/../../shared/peers/load_bench.py"; CONC=${CONC:-4,16}
source "$(dirname "$0")/lib.sh"  # wait_health
load() { $PP "$LOAD" --base-url http://127.0.0.1:8398 --model m --tokenizer "$M110" --prompt-len 128 --max-tokens 64 \
           --concurrency "$CONC" --stack "$1" --ignore-eos --out "$OUT" "${@:2}" 2>&1 | grep "done:"; }
"$PR/build-native/bin/llama-server" -m "$PR/models/gguf/llama110m-random-f32.gguf" --host 127.0.0.1 --port 8398 \
  -c 16384 --parallel 16 --cont-batching -t "$(nproc)" -tb "$(nproc)" > "${OUT%.jsonl}-llama-server.log" 2>&1 & P=$!
wait_health http://127.0.0.1:8398; load llama-server --no-keepalive; kill $P; wait $P 2>/dev/null
for flags in "$@"; do
  .venv/bin/jaxserve serve --model "$M110" --max-num-seqs 16 --max-model-len 1024 --host 127.0.0.1 --port 8398 \
    --served-model-name m --warmup full $flags > "${OUT%.jsonl}-$(echo "${flags:-default}" | tr -c 'a-z0-9.\n' _).log" 2>&1 & P=$!
  wait_health http://127.0.0.1:8398; load "jaxserve ${flags:-(defaults)}"; kill $P; wait $P 2>/dev/null
done
$PP - "$OUT" <<'PY'
import json, sys
print("| stack and flags | conc | output tok/s | TTFT p50 ms | ITL p50 ms | ITL p99 ms |\n|---|---:|---:|---:|---:|---:|")
for line in open(sys.argv[1]):
    r = json.loads(line); m = r["metrics"]
    print(f"| {r['stack']} | {m['concurrency']} | {m['output_throughput_tok_s']:.1f} | {m['ttft_ms']['p50']:.0f} | "
          f"{m['itl_ms']['p50']:.1f} | {m['itl_ms']['p99']:.1f} |")
PY
