#!/usr/bin/env bash
# `jaxserve bench serve` beside ../shared/peers/load_bench.py: the same load against the same servers in
# one run (llama-server and jaxserve, stories260K and the random 124.7M Llama, concurrency 1, 4 and 16,
# token-id prompts, ignore_eos, more requests at higher concurrency; four or eight rounds, the two tools measuring each
# level back to back, in alternating order), then a table of each figure's ratio between the two tools and a
# plot of both servers on the same axes. The two tools must agree within 10%. Needs ../shared/peers/setup.sh once.
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
source benchmarks/lib.sh  # wait_health
measure() { # url tokenizer prompt-len "n1 n4 n16" name rounds: in each round, every level is measured by
  # both tools back to back, with new prompts each time. This machine's speed drifts by tens of percent
  # within minutes, at times steadily: in one run the tool measured second was 13-23% slower in all three
  # rounds of a level (llama-server, concurrency 4), and faster when the order was swapped. So the two tools' figures are compared pair by pair, the order
  # alternates between rounds (load_bench.py first in odd rounds, bench serve first in even ones), and
  # the table takes the geometric mean of the paired ratios, in which a steady drift cancels out.
  local counts=($4)
  for round in $(seq 1 "$6"); do
    for i in 0 1 2; do
      c=$(( 4 ** i ))
      lb() { $CLIENT $PP ../shared/peers/load_bench.py --base-url "$1" --model m --tokenizer "$2" --prompt-mode ids \
        --prompt-len "$3" --max-tokens 64 --concurrency $c --num-prompts "${counts[$i]}" --ignore-eos --stack "$5" \
        --seed $((round * 100 + c)) --out "$OUT/load_bench.jsonl" 2>&1 | grep "done:"; }
      bs() { $CLIENT .venv/bin/jaxserve bench serve --base-url "$1" --model m --tokenizer "$2" --random-input-len "$3" \
        --random-output-len 64 --num-prompts "${counts[$i]}" --max-concurrency $c --ignore-eos --no-progress \
        --seed $((round * 100 + 50 + c)) --label "$5" --save-result "$OUT/$5-r$round-c$c.json" | tail -1; }
      if [ $((round % 2)) = 1 ]; then lb "$@"; bs "$@"; else bs "$@"; lb "$@"; fi
    done
  done
}
for model in stories260K llama110m-random; do
  # Requests per level (concurrency 1, 4, 16). At 16, four waves: closed-loop requests of one output
  # length arrive in waves, and with two waves the TTFT median sits exactly between the first wave's
  # (queued behind each other's prefill) and the second's; from the third wave on, arrivals are staggered.
  # stories260K runs at thousands of tokens a second: more requests, so a level lasts 5-20 s rather than
  # 2-10 s; at half these counts its medians still scattered by 10-30% from round to round, and at these
  # by 15-40% at concurrency 4 (paired ratios 1.27, 1.38, 0.84, 1.06 in one run): the noise comes in
  # bursts of seconds, not request by request, so it takes more pairs, not longer ones. Eight rounds
  # there, four for llama110m-random, whose ratios stay within a few percent.
  if [ $model = stories260K ]; then dir=$S260; len=64; n="128 256 512"; ctx=512; rounds=8
  else dir=$M110; len=128; n="32 32 64"; ctx=1024; rounds=4; fi
  echo "== $model: llama-server"
  $SERVER "$PR/build-native/bin/llama-server" -m "$PR/models/gguf/$model-f32.gguf" --host 127.0.0.1 --port 8321 \
    -c $((ctx * 16)) --parallel 16 --cont-batching -t $T -tb $T > "$OUT/llama-server-$model.log" 2>&1 & P=$!
  wait_health http://127.0.0.1:8321; measure http://127.0.0.1:8321 "$dir" $len "$n" "llama-server-$model" $rounds; kill $P; wait $P 2>/dev/null || true
  echo "== $model: jaxserve"
  $SERVER .venv/bin/jaxserve serve --model "$dir" --max-num-seqs 16 --max-model-len $ctx --host 127.0.0.1 --port 8322 \
    --served-model-name m --warmup full > "$OUT/jaxserve-$model.log" 2>&1 & P=$!
  wait_health http://127.0.0.1:8322; measure http://127.0.0.1:8322 "$dir" $len "$n" "jaxserve-$model" $rounds; kill $P; wait $P 2>/dev/null || true
done
.venv/bin/python - "$OUT" <<'PY'
import collections, json, re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
# For each server, level and round: (output tok/s, TTFT p50, ITL p50) from each tool, measured back to back.
theirs, ours = collections.defaultdict(list), collections.defaultdict(dict)
for line in open(out / "load_bench.jsonl"):
    r = json.loads(line)
    if r.get("bench") == "serve":
        m = r["metrics"]
        theirs[(r["stack"], m["concurrency"])].append((m["output_throughput_tok_s"], m["ttft_ms"]["p50"], m["itl_ms"]["p50"]))
levels_by_label = collections.defaultdict(list)
for file in sorted(out.glob("*-r*-c*.json")):
    match = re.search(r"-r(\d+)-c\d+$", file.stem)
    if not match:
        continue
    report = json.loads(file.read_text())
    round_ = int(match.group(1))
    for level in report["levels"]:
        m = level["metrics"]
        ours[(report["label"], level["max_concurrency"])][round_] = (m["output_throughput"], m["ttft_ms"]["p50"], m["itl_ms"]["p50"])
        if round_ == 2:  # one middle round, for the plots
            levels_by_label[report["label"]].append(level)
for label, levels in levels_by_label.items():
    report = {"label": label, "levels": sorted(levels, key=lambda level: level["max_concurrency"])}
    (out / f"{label}.json").write_text(json.dumps(report))
print("\n| server | conc | out tok/s (load_bench / bench serve) | TTFT p50 ms | ITL p50 ms | rounds | paired ratios, geometric mean over the rounds (tok/s, TTFT, ITL) |")
print("|---|---:|---|---|---|---:|---|")
worst = 0.0
for key in sorted(ours):
    rounds = sorted(ours[key])
    a_rows, b_rows = theirs[key][-len(rounds):], [ours[key][r] for r in rounds]
    a = [statistics.median(x) for x in zip(*a_rows)]
    b = [statistics.median(x) for x in zip(*b_rows)]
    paired = [statistics.geometric_mean(y / x for x, y in zip(xs, ys)) for xs, ys in zip(zip(*a_rows), zip(*b_rows))]
    worst = max(worst, *(abs(r - 1) for r in paired))
    print(f"| {key[0]} | {key[1]} | " + " | ".join(f"{x:.2f} / {y:.2f}" for x, y in zip(a, b)) + f" | {len(rounds)} | "
          + ", ".join(f"{r:.3f}" for r in paired) + " |")
print(f"\nlargest disagreement (paired, geometric mean over rounds): {100 * worst:.1f}% (target: within 10%)")
PY
for model in stories260K llama110m-random; do
  .venv/bin/jaxserve bench plot "$OUT/llama-server-$model.json" "$OUT/jaxserve-$model.json" --out "$OUT/plots-$model"
done
echo "results: $OUT"
