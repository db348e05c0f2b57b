#!/usr/bin/env bash
# Issue 27's comparison in one run: jaxserve int8 (weights and KV pages) against llama.cpp Q8_0 on the
# random 124.7M Llama, and both against their float32.
# 1. Served, one server at a time on the same load as ../shared/peers/side_by_side.sh (128-token prompts,
#    64 output tokens with ignore_eos, concurrency 1 and 16): llama-server f32 and Q8_0, jaxserve f32 and
#    int8. Each server's resident memory (RSS) is read after its load.
# 2. Offline batch-1 decode: llama-bench tg128 on f32 and Q8_0; jaxserve's LLM (offline_decode.py) in
#    float32 and int8.
# Needs ../shared/peers/setup.sh to have run once (the models, Q8_0 GGUF included, and the binaries).
#   benchmarks/quantized_vs_llama_cpp.sh [OUT.jsonl]          CONC=1,16 to change the load
set -u
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}; PP=$PR/venv/bin/python
OUT=${1:-$PR/results/quantized-$(date +%Y%m%d-%H%M%S).jsonl}; : > "$OUT"
LS=$PR/build-native/bin/llama-server; LB=$PR/build-native/bin/llama-bench
M110=$PR/models/llama110m-random; GG=$PR/models/gguf/llama110m-random
CONC=${CONC:-1,16}; PORT=8311
mkdir -p "$PR/logs"
./dev run true  # .venv exists and is current
source benchmarks/lib.sh  # wait_health
measure() { # pid stack [load options]: the load, then the server's RSS as one JSON line
  if ! wait_health http://127.0.0.1:$PORT 600 "$1"; then echo "$2: the server never answered /health" >&2; return 1; fi
  $PP ../shared/peers/load_bench.py --base-url http://127.0.0.1:$PORT --model m --tokenizer "$M110" \
    --prompt-len 128 --max-tokens 64 --concurrency "$CONC" --stack "$2" --ignore-eos --out "$OUT" "${@:3}" 2>&1 \
    | grep "done:"
  echo "{\"stack\": \"$2\", \"rss_mb\": $(( $(ps -o rss= -p "$1") / 1024 ))}" | tee -a "$OUT"
  kill "$1"; while kill -0 "$1" 2>/dev/null; do sleep 0.2; done  # the port is free for the next server
}
start_llama() { # quant [flags]: llama-server in the background, its PID on stdout
  "$LS" -m "$GG-$1.gguf" --host 127.0.0.1 --port $PORT -c 16384 --parallel 16 --cont-batching \
    -t "$(nproc)" -tb "$(nproc)" "${@:2}" > "$PR/logs/llama-server-$1.log" 2>&1 & echo $!
}
for quant in f32 q8_0; do
  P=$(start_llama $quant)
  if ! wait_health http://127.0.0.1:$PORT 120 "$P"; then
    # llama-server crashed while repacking Q8_0 weights on an Intel Xeon with AMX (2026-12-04) where
    # llama-bench, with the same repacking, did not: run it without, and say so beside the figures.
    echo "{\"stack\": \"llama-server-$quant\", \"note\": \"exited while starting; run with --no-repack\"}" | tee -a "$OUT"
    kill "$P" 2>/dev/null; P=$(start_llama $quant --no-repack)
  fi
  measure "$P" "llama-server-$quant" --no-keepalive  # as side_by_side.sh loads llama-server
done
# jaxserve's int8 run: weights, LM head (as the Q8_0 file stores it) and KV pages
int8_flags() { if [ "$1" = int8 ]; then echo --quantization int8 --quantize-lm-head --kv-cache-dtype int8; fi; }
for quant in none int8; do
  .venv/bin/jaxserve serve --model "$M110" --max-num-seqs 16 --max-model-len 1024 --host 127.0.0.1 --port $PORT \
    --served-model-name m --warmup full $(int8_flags $quant) > "$PR/logs/jaxserve-$quant.log" 2>&1 &
  measure $! "jaxserve-$quant"
  grep -m1 "precision:" "$PR/logs/jaxserve-$quant.log"
done
for quant in f32 q8_0; do
  "$LB" -m "$GG-$quant.gguf" -p 0 -n 128 -t "$(nproc)" -r 3 -o json 2>/dev/null | $PP -c \
    "import json,sys; [print(json.dumps({'stack': 'llama-bench-$quant', 'n_gen': r['n_gen'], 'tok_s': r['avg_ts']})) for r in json.load(sys.stdin)]" \
    | tee -a "$OUT"
done
for quant in none int8; do
  ./dev run python benchmarks/offline_decode.py --model "$M110" $(int8_flags $quant) 2>/dev/null | grep '^{' \
    | $PP -c "import json,sys; r=json.loads(sys.stdin.read()); r['stack']='jaxserve-offline-$quant'; print(json.dumps(r))" \
    | tee -a "$OUT"
done
$PP - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
served = {(r["stack"], r["metrics"]["concurrency"]): r["metrics"] for r in rows if "metrics" in r}
rss = {r["stack"]: r["rss_mb"] for r in rows if "rss_mb" in r}
offline = {r["stack"]: r["tok_s"] for r in rows if "tok_s" in r}
ratio = lambda a, b: f"{a / b:.2f}x" if a == a and b == b and b > 0 else "n/a"  # a missing figure is nan
print("\n| served, concurrency | llama-server f32 | llama-server Q8_0 | jaxserve f32 | jaxserve int8 | int8 / Q8_0 |")
print("|---|---:|---:|---:|---:|---:|")
for conc in sorted({c for _, c in served}):
    tok = [served.get((s, conc), {}).get("output_throughput_tok_s", float("nan")) for s in
           ("llama-server-f32", "llama-server-q8_0", "jaxserve-none", "jaxserve-int8")]
    print(f"| output tok/s, {conc} | " + " | ".join(f"{t:.1f}" for t in tok) + f" | {ratio(tok[3], tok[1])} |")
print("| RSS MB | " + " | ".join(str(rss.get(s, "?")) for s in ("llama-server-f32", "llama-server-q8_0", "jaxserve-none",
                                                                 "jaxserve-int8"))
      + f" | {ratio(rss.get('jaxserve-int8', float('nan')), rss.get('llama-server-q8_0', float('nan')))} |")
tok = [offline.get(s, float("nan")) for s in ("llama-bench-f32", "llama-bench-q8_0", "jaxserve-offline-none",
                                             "jaxserve-offline-int8")]
print(f"| batch-1 decode tok/s (llama-bench tg128 / LLM) | " + " | ".join(f"{t:.1f}" for t in tok)
      + f" | {ratio(tok[3], tok[1])} |")
for r in rows:
    if "note" in r:
        print(f"{r['stack']}: {r['note']}")
PY
echo "Reproduce: benchmarks/quantized_vs_llama_cpp.sh $OUT"
