#!/usr/bin/env bash
# An A/B of two jaxserve revisions on the load of ../shared/peers/side_by_side.sh (llama110m-random,
# prompt 128, 64 output tokens, --ignore-eos, --warmup full, --max-num-seqs 16), served in turn
# before, after, before, after on one port, so machine noise falls on both; one JSON line per level in OUT
# and a markdown table at the end. BEFORE and AFTER are checkouts with a .venv (`./dev run true` makes it):
#   git worktree add /tmp/ab_before REV1 && (cd /tmp/ab_before && ./dev run true)   (same for AFTER)
#   [CONC=1,4,16] benchmarks/ab_revisions.sh /tmp/ab_before /tmp/ab_after [OUT]
# The model and the load generator come from ../shared/peers/setup.sh (under ~/.cache/jaxserve-peers).
set -u
BEFORE=$1; AFTER=$2
PR=$HOME/.cache/jaxserve-peers; PP=$PR/venv/bin/python; M110=$PR/models/llama110m-random
OUT=${3:-/tmp/ab_revisions.jsonl}; CONC=${CONC:-1,4,16}; : > "$OUT"
source "$(dirname "$0")/lib.sh"  # wait_health
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then D=$BEFORE; else D=$AFTER; fi
    "$D/.venv/bin/jaxserve" serve --model "$M110" --max-num-seqs 16 --max-model-len 1024 --host 127.0.0.1 \
      --port 8399 --served-model-name m --warmup full > "${OUT%.jsonl}-$side-$round.log" 2>&1 & P=$!
    wait_health http://127.0.0.1:8399
    $PP "$(dirname "$0")/../../shared/peers/load_bench.py" --base-url http://127.0.0.1:8399 --model m --tokenizer "$M110" \
      --prompt-len 128 --max-tokens 64 --concurrency "$CONC" --stack "$side-$round" --ignore-eos --out "$OUT" 2>&1 | grep "done:"
    kill $P; wait $P 2>/dev/null
  done
done
$PP - "$OUT" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = collections.defaultdict(dict)
for r in rows:
    m = r["metrics"]; by[m["concurrency"]][r["stack"]] = m
print("| conc | round | before tok/s | after tok/s | after/before | TTFT p50 ms (b / a) | ITL p50 ms (b / a) | ITL p99 ms (b / a) |")
print("|---:|---:|---:|---:|---:|---|---|---|")
for c in sorted(by):
    for rnd in (1, 2):
        b, a = by[c].get(f"before-{rnd}"), by[c].get(f"after-{rnd}")
        if not (a and b): continue
        print(f"| {c} | {rnd} | {b['output_throughput_tok_s']:.1f} | {a['output_throughput_tok_s']:.1f} | "
              f"{a['output_throughput_tok_s'] / b['output_throughput_tok_s']:.2f}x | {b['ttft_ms']['p50']:.0f} / {a['ttft_ms']['p50']:.0f} | "
              f"{b['itl_ms']['p50']:.1f} / {a['itl_ms']['p50']:.1f} | {b['itl_ms']['p99']:.1f} / {a['itl_ms']['p99']:.1f} |")
PY
