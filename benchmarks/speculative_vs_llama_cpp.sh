#!/usr/bin/env bash
# Issue 26's served comparison in one run: llama-server against jaxserve with speculation off and with prompt
# lookup (ngram, K = 4, n-grams of 2..4), one server at a time, on the same token ids, for stories260K and
# the random 124.7M Llama:
# - retold: the model's own greedy story from an opening, then the opening again (an answer that is in its
#   prompt, as when quoting, summarising or editing a text); grounded: a fixed story told twice and begun a
#   third time; both written by `benchmarks/speculative.py --write-prompts`.
# - random: random token prompts of side_by_side.sh's lengths (64 tokens for stories260K, 128 for 124.7M).
# 64 greedy output tokens with ignore_eos, concurrency 1, 4 and 16 (`jaxserve bench serve`, one call a level,
# so jaxserve's draft acceptance of each level is read from /metrics around it). llama-server drafts only with
# a second, smaller model of the same vocabulary (`--model-draft`); none exists here, so it runs plain.
# Needs ../shared/peers/setup.sh to have run once (the binaries, the 124.7M model and both GGUFs).
#   benchmarks/speculative_vs_llama_cpp.sh [OUT.jsonl]      MODELS="stories260K llama110m-random" CONC=1,4,16
set -u
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}
OUT=${1:-$PR/results/speculative-$(date +%Y%m%d-%H%M%S).jsonl}; : > "$OUT"
LS=$PR/build-native/bin/llama-server; JX=.venv/bin/jaxserve
MODELS=${MODELS:-stories260K llama110m-random}; CONC=${CONC:-1,4,16}; PORT=8321; URL=http://127.0.0.1:$PORT
NGRAM='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$PR/logs"
./dev run true  # .venv exists and is current
source benchmarks/lib.sh  # wait_health

model_dir() { if [ "$1" = stories260K ]; then echo ../shared/models/stories260K; else echo "$PR/models/$1"; fi; }
prompt_len() { if [ "$1" = stories260K ]; then echo 64; else echo 128; fi; }
max_len() { if [ "$1" = stories260K ]; then echo 512; else echo 1024; fi; }  # stories260K: 512 positions
# Requests per level: max(32, 8c) for stories260K, max(8, 2c) for the 124.7M model (about as many seconds).
requests() { local per=2 least=8; [ "$1" = stories260K ] && per=8 least=32
  echo $(( per * $2 > least ? per * $2 : least )); }

spec_counters() { # drafted and accepted draft tokens so far (0 0 from a server without speculation)
  curl -sf "$URL/metrics" | awk '/^jaxserve:spec_decode_num_draft_tokens_total/ {d=$2}
    /^jaxserve:spec_decode_num_accepted_tokens_total/ {a=$2} END {printf "%d %d\n", d, a}'
}

load() { # model stack workload: each level, one JSON line
  local model=$1 stack=$2 kind=$3 dir; dir=$(model_dir "$1")
  for c in ${CONC//,/ }; do
    local n; n=$(requests "$model" "$c")
    local data=(--dataset-name jsonl --dataset-path "$WORK/$model-$kind.jsonl")
    if [ "$kind" = random ]; then
      data=(--dataset-name random --tokenizer "$dir" --random-input-len "$(prompt_len "$model")"
            --random-output-len 64 --random-prompt-form ids)
    fi
    read -r d0 a0 < <(spec_counters)
    "$JX" bench serve --base-url "$URL" --model m "${data[@]}" --num-prompts "$n" --max-concurrency "$c" \
      --ignore-eos --temperature 0 --num-warmups 1 --no-progress --save-result "$WORK/level.json" > /dev/null || return 1
    read -r d1 a1 < <(spec_counters)
    python3 - "$WORK/level.json" "$model" "$stack" "$kind" "$c" "$((d1 - d0))" "$((a1 - a0))" <<'PY' | tee -a "$OUT"
import json, sys
path, model, stack, kind, c, drafted, accepted = sys.argv[1:]
m = json.load(open(path))["levels"][0]["metrics"]
print(json.dumps({"bench": "speculative-served", "model": model, "stack": stack, "workload": kind,
                  "concurrency": int(c), "requests": m["completed"], "failed": m["failed"],
                  "output_tok_s": round(m["output_throughput"], 1), "draft_tokens": int(drafted),
                  "accepted_tokens": int(accepted)}))
PY
  done
}

for model in $MODELS; do
  dir=$(model_dir "$model")
  for kind in retold grounded; do
    ./dev run python benchmarks/speculative.py --model "$dir" --write-prompts "$WORK/$model-$kind.jsonl" \
      --workload "$kind" --requests 64 2>/dev/null || exit 1
  done
  "$LS" -m "$PR/models/gguf/$model-f32.gguf" --host 127.0.0.1 --port $PORT -c 16384 --parallel 16 \
    --cont-batching -t "$(nproc)" -tb "$(nproc)" > "$PR/logs/llama-server-spec.log" 2>&1 &
  pid=$!; wait_health "$URL" 600 $pid || { echo "server failed: see $PR/logs" >&2; exit 1; }
  for kind in retold grounded random; do load "$model" llama-server "$kind"; done
  kill $pid; wait $pid 2>/dev/null
  for stack in jaxserve-off jaxserve-ngram; do
    spec=(); [ "$stack" = jaxserve-ngram ] && spec=(--speculative-config "$NGRAM")
    "$JX" serve --model "$dir" --max-num-seqs 16 --max-model-len "$(max_len "$model")" --host 127.0.0.1 --port $PORT \
      --served-model-name m --warmup full "${spec[@]}" > "$PR/logs/jaxserve-$stack.log" 2>&1 &
    pid=$!; wait_health "$URL" 600 $pid || { echo "server failed: see $PR/logs" >&2; exit 1; }
    for kind in retold grounded random; do load "$model" "$stack" "$kind"; done
    kill $pid; wait $pid 2>/dev/null
  done
done

python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
tok = {(r["model"], r["workload"], r["concurrency"], r["stack"]): r for r in rows}
print("\n| model | workload | conc | llama-server | jaxserve off | jaxserve ngram | ngram / off | ngram / llama-server "
      "| acceptance |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for (model, kind, c, stack), r in tok.items():
    if stack != "jaxserve-ngram":
        continue
    ls, off = tok.get((model, kind, c, "llama-server")), tok.get((model, kind, c, "jaxserve-off"))
    if not (ls and off):
        continue
    acc = r["accepted_tokens"] / r["draft_tokens"] if r["draft_tokens"] else 0.0
    print(f"| {model} | {kind} | {c} | {ls['output_tok_s']} | {off['output_tok_s']} | {r['output_tok_s']} | "
          f"{r['output_tok_s'] / off['output_tok_s']:.2f}x | {r['output_tok_s'] / ls['output_tok_s']:.2f}x | {acc:.2f} |")
PY
echo "Reproduce: benchmarks/speculative_vs_llama_cpp.sh $OUT"
