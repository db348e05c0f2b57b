#!/usr/bin/env bash
# An A/B of two jaxserve revisions on the load of ../shared/peers/side_by_side.sh (llama110m-random,
# prompt 128, 64 output tokens, --ignore-eos, --warmup full, --max-num-seqs 16). Both revisions serve at
# once, on two ports (an idle server sleeps), each from its own checkout's code (PYTHONPATH: a worktree
# whose .venv is shared still imports its own tree); each concurrency level runs on one and at once on the
# other, the first of the pair alternating from level to level and from round to round, so the two runs of
# a ratio are seconds apart and a machine whose pace drifts favours neither. One JSON line per level in
# OUT, a markdown table at the end with after / before per round and over all rounds.
#   git worktree add /tmp/ab_before REV1   (a checkout of each revision; .venv: `./dev run true`, or a link
#                                           to one whose packages fit both revisions)
#   [CONC=1,4,16] [ROUNDS=2] benchmarks/ab_revisions.sh /tmp/ab_before /tmp/ab_after [OUT]
# The model and the load generator come from ../shared/peers/setup.sh (under ~/.cache/jaxserve-peers).
set -u
BEFORE=$(cd "$1" && pwd); AFTER=$(cd "$2" && pwd)
PR=$HOME/.cache/jaxserve-peers; PP=$PR/venv/bin/python; M110=$PR/models/llama110m-random
OUT=${3:-/tmp/ab_revisions.jsonl}; CONC=${CONC:-1,4,16}; ROUNDS=${ROUNDS:-2}; : > "$OUT"
LOAD=$(cd "$(dirname "$0")/../../shared/peers" && pwd)/load_bench.py
source "$(dirname "$0")/lib.sh"  # wait_health
declare -A port=([before]=8398 [after]=8399) dir=([before]=$BEFORE [after]=$AFTER) pid
for side in before after; do
  D=${dir[$side]}
  PYTHONPATH=$D "$D/.venv/bin/python" -m jaxserve serve --model "$M110" --max-num-seqs 16 --max-model-len 1024 \
    --host 127.0.0.1 --port "${port[$side]}" --served-model-name m --warmup full > "${OUT%.jsonl}-$side.log" 2>&1 &
  pid[$side]=$!
  wait_health "http://127.0.0.1:${port[$side]}" 900 "${pid[$side]}" || { echo "$side failed: ${OUT%.jsonl}-$side.log"; exit 1; }
done
trap 'kill ${pid[before]} ${pid[after]} 2>/dev/null; wait 2>/dev/null' EXIT
for round in $(seq 1 "$ROUNDS"); do
  level=0
  for c in ${CONC//,/ }; do
    sides="before after"; [ $(((level + round) % 2)) = 0 ] && sides="after before"
    for side in $sides; do
      $PP "$LOAD" --base-url "http://127.0.0.1:${port[$side]}" --model m --tokenizer "$M110" --prompt-len 128 \
        --max-tokens 64 --concurrency "$c" --stack "$side-$round" --ignore-eos --out "$OUT" 2>&1 | grep "done:"
    done
    level=$((level + 1))
  done
done
$PP - "$OUT" "$ROUNDS" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rounds = range(1, int(sys.argv[2]) + 1)
by = collections.defaultdict(dict)
for r in rows:
    m = r["metrics"]; by[m["concurrency"]][r["stack"]] = m
tok = lambda m: m["output_throughput_tok_s"]
print("| conc | round | before tok/s | after tok/s | after/before | TTFT p50 ms (b / a) | ITL p50 ms (b / a) | ITL p99 ms (b / a) |")
print("|---:|---:|---:|---:|---:|---|---|---|")
for c in sorted(by):
    pairs = [(by[c].get(f"before-{n}"), by[c].get(f"after-{n}"), n) for n in rounds]
    pairs = [(b, a, n) for b, a, n in pairs if a and b]
    for b, a, n in pairs:
        print(f"| {c} | {n} | {tok(b):.1f} | {tok(a):.1f} | {tok(a) / tok(b):.2f}x | {b['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p50']:.0f} | "
              f"{b['itl_ms']['p50']:.1f} / {a['itl_ms']['p50']:.1f} | {b['itl_ms']['p99']:.1f} / {a['itl_ms']['p99']:.1f} |")
    if pairs:
        print(f"| {c} | all | | | **{sum(tok(a) for _, a, _ in pairs) / sum(tok(b) for b, _, _ in pairs):.2f}x** | | | |")
PY
