#!/usr/bin/env bash
# `jaxserve bench serve` beside ../shared/peers/load_bench.py: the same load against the same servers in
# one run (llama-server and jaxserve, stories260K and the random 124.7M Llama, concurrency 1, 4 and 16,
# token-id prompts, ignore_eos, more requests at higher concurrency; three rounds with the tools alternating), then a table of each figure's ratio between the two tools and a plot of
# both servers on the same axes. The two tools must agree within 10%. Needs ../shared/peers/setup.sh once.
#   benchmarks/bench_serve_agreement.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}
OUT=${1:-$PR/results/bench-agreement-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
./dev run true
# Both tools run under the same interpreter and httpx (this project's venv), so that what differs between
# them is the tool, not the Python that runs it: at thousands of chunks a second on one core the client's
# own cost per chunk shows in TTFT.
PP=.venv/bin/python; S260=../shared/models/stories260K; M110=$PR/models/llama110m-random
# The server and the load generator get cores of their own: sharing them, a client that spends more CPU
# per chunk slows the server it measures, and the two tools would then disagree about the server rather
# than about its figures. Last core: the client; the rest: the server.
N=$(nproc)
if [ "$N" -ge 2 ]; then SERVER="taskset -c 0-$((N - 2))"; CLIENT="taskset -c $((N - 1))"; T=$((N - 1)); else SERVER=""; CLIENT=""; T=1; fi
wait_health() { for _ in $(seq 1 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
measure() { # url tokenizer prompt-len "n1 n4 n16" name: three rounds, the tools alternating, new prompts each
  local counts=($4)
  for round in 1 2 3; do
    for i in 0 1 2; do
      c=$(( 4 ** i ))
      $CLIENT $PP ../shared/peers/load_bench.py --base-url "$1" --model m --tokenizer "$2" --prompt-mode ids --prompt-len "$3" \
        --max-tokens 64 --concurrency $c --num-prompts "${counts[$i]}" --ignore-eos --stack "$5" --seed $((round * 100 + c)) \
        --out "$OUT/load_bench.jsonl" 2>&1 | grep "done:"
    done
    $CLIENT .venv/bin/jaxserve bench serve --base-url "$1" --model m --tokenizer "$2" --random-input-len $(( $3 - 1 )) \
      --random-output-len 64 --num-prompts "${4// /,}" --max-concurrency 1,4,16 --ignore-eos --no-progress \
      --seed $((round * 100 + 50)) --label "$5" --save-result "$OUT/$5-$round.json" | tail -3
  done
  cp "$OUT/$5-2.json" "$OUT/$5.json"  # the middle round, for the plot
}
for model in stories260K llama110m-random; do
  # Requests per level (concurrency 1, 4, 16). At 16, four waves: closed-loop requests of one output
  # length arrive in waves, and with two waves the TTFT median sits exactly between the first wave's
  # (queued behind each other's prefill) and the second's; from the third wave on, arrivals are staggered.
  # stories260K runs at thousands of tokens a second: more requests, so a level lasts seconds, not one.
  if [ $model = stories260K ]; then dir=$S260; len=64; n="64 128 256"; ctx=512; else dir=$M110; len=128; n="32 32 64"; ctx=1024; fi
  echo "== $model: llama-server"
  $SERVER "$PR/build-native/bin/llama-server" -m "$PR/models/gguf/$model-f32.gguf" --host 127.0.0.1 --port 8321 \
    -c $((ctx * 16)) --parallel 16 --cont-batching -t $T -tb $T > "$OUT/llama-server-$model.log" 2>&1 & P=$!
  wait_health http://127.0.0.1:8321; measure http://127.0.0.1:8321 "$dir" $len "$n" "llama-server-$model"; kill $P; wait $P 2>/dev/null || true
  echo "== $model: jaxserve"
  $SERVER .venv/bin/jaxserve serve --model "$dir" --max-num-seqs 16 --max-model-len $ctx --host 127.0.0.1 --port 8322 \
    --served-model-name m --warmup full > "$OUT/jaxserve-$model.log" 2>&1 & P=$!
  wait_health http://127.0.0.1:8322; measure http://127.0.0.1:8322 "$dir" $len "$n" "jaxserve-$model"; kill $P; wait $P 2>/dev/null || true
done
.venv/bin/python - "$OUT" <<'PY'
import collections, json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
# Medians over the three rounds of each tool: the machine's noise between rounds is about 10% by itself.
theirs, ours = collections.defaultdict(list), collections.defaultdict(list)
for line in open(out / "load_bench.jsonl"):
    r = json.loads(line)
    if r.get("bench") == "serve":
        m = r["metrics"]
        theirs[(r["stack"], m["concurrency"])].append((m["output_throughput_tok_s"], m["ttft_ms"]["p50"], m["itl_ms"]["p50"]))
for file in sorted(out.glob("*-[123].json")):
    report = json.loads(file.read_text())
    for level in report["levels"]:
        m = level["metrics"]
        ours[(report["label"], level["max_concurrency"])].append((m["output_throughput"], m["ttft_ms"]["p50"], m["itl_ms"]["p50"]))
print("\n| server | conc | out tok/s (load_bench / bench serve) | TTFT p50 ms | ITL p50 ms | furthest ratio |")
print("|---|---:|---|---|---|---:|")
worst = 0.0
for key in sorted(ours):
    a = [statistics.median(x) for x in zip(*theirs[key])]
    b = [statistics.median(x) for x in zip(*ours[key])]
    far = max((y / x for x, y in zip(a, b)), key=lambda r: abs(r - 1))
    worst = max(worst, abs(far - 1))
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{x:.2f} / {y:.2f}" for x, y in zip(a, b)) + f" | {far:.3f} |")
print(f"\nlargest disagreement of the medians: {100 * worst:.1f}% (target: within 10%)")
PY
for model in stories260K llama110m-random; do
  .venv/bin/jaxserve bench plot "$OUT/llama-server-$model.json" "$OUT/jaxserve-$model.json" --out "$OUT/plots-$model"
done
echo "results: $OUT"
