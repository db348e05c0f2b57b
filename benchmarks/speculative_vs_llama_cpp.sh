#!/usr/bin/env bash
# Speculation on against off, served, in one run (issues 26 and 54): jaxserve without speculation and with
# prompt lookup (ngram, K = 4, n-grams of 2..4, everything else default: every step priced), one server at a
# time, on the same token ids, for stories260K and the random 124.7M Llama; llama-server beside them with
# LLAMA_SERVER=1 (plain: it drafts only with a second model of the same vocabulary, and none exists here).
# - retold: the model's own greedy story from an opening, then the opening again (an answer that is in its
#   prompt, as when quoting, summarising or editing a text); grounded: a fixed story told twice and begun a
#   third time; both written by `benchmarks/speculative.py --write-prompts`.
# - random: random token prompts of side_by_side.sh's lengths (64 tokens for stories260K, 128 for 124.7M).
# 64 greedy output tokens with ignore_eos, concurrency 1, 4 and 16 (llama-server: `jaxserve bench serve`, one call
# a level; the ngram server's draft acceptance and steps drafting are read from its /metrics around each level).
# Both jaxserve servers are up side by side (an idle one sleeps), started afresh each round, which one first
# alternating from round to round (the second started serves faster: below); each level's requests are cut
# into chunks sent to one server and then the other, chunk by chunk (`benchmarks/served_pair.py`: on this 2-core machine
# one run per server swung 0.84-1.26x between two identical servers, chunks in alternation 0.98-1.09x), the
# first of each pair alternating from chunk to chunk, from level to level and from round to round, so that a
# machine whose pace drifts favours neither. ROUNDS rounds (default 2).
# Each level is one JSON line in OUT; the table of ngram / off per round and over all rounds comes last, and
# OUT's .summary.json holds it.
# The 124.7M model needs ../shared/peers/setup.sh to have run once (it also builds llama-server).
#   benchmarks/speculative_vs_llama_cpp.sh [OUT.jsonl]
#   env: MODELS="stories260K llama110m-random" WORKLOADS="retold grounded random" CONC=1,4,16 ROUNDS=2
#        LLAMA_SERVER=0|1 REQUESTS=N (every level; default about as many seconds per level for both models)
#        PY=python (default: ./dev run true, then .venv/bin/python)
#        SPEC_CONFIG='{...}' (the second server's --speculative-config; `none`: an A/A run, both without, to see
#        how far two identical servers drift apart on this machine)
set -u
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}
OUT=${1:-$PR/results/speculative-$(date +%Y%m%d-%H%M%S).jsonl}; mkdir -p "$(dirname "$OUT")"; : > "$OUT"
LS=$PR/build-native/bin/llama-server
MODELS=${MODELS:-stories260K llama110m-random}; WORKLOADS=${WORKLOADS:-retold grounded random}
CONC=${CONC:-1,4,16}; ROUNDS=${ROUNDS:-2}; LLAMA_SERVER=${LLAMA_SERVER:-0}; PORT=8321; URL=http://127.0.0.1:$PORT  # llama-server; jaxserve off / ngram: 8322 / 8323
NGRAM=${SPEC_CONFIG:-'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'}
WORK=$(mktemp -d)
mkdir -p "$PR/logs"
if [ -z "${PY:-}" ]; then ./dev run true && PY=.venv/bin/python; fi  # .venv exists and is current
JX="$PY -m jaxserve"
source benchmarks/lib.sh  # wait_health

model_dir() { if [ "$1" = stories260K ]; then echo ../shared/models/stories260K; else echo "$PR/models/$1"; fi; }
prompt_len() { if [ "$1" = stories260K ]; then echo 64; else echo 128; fi; }
max_len() { if [ "$1" = stories260K ]; then echo 512; else echo 1024; fi; }  # stories260K: 512 positions
# Requests per level: max(256, 128c) for stories260K (16 chunks of 8-16 requests a stream, about a second each:
# 12-26 s a server a round, so that a level's two rounds tell a 3% cost from the machine's noise: with
# max(128, 32c), 3 s at 4 streams in 4 chunks, the A/A run's levels spread 0.94-1.12x), max(8, 2c) for the
# 124.7M model (one chunk: its steps are compute-bound and swing less).
requests() { [ -n "${REQUESTS:-}" ] && { echo "$REQUESTS"; return; }
  local per=2 least=8; [ "$1" = stories260K ] && per=128 least=256
  echo $(( per * $2 > least ? per * $2 : least )); }

spec_counters() { # URL: drafted and accepted draft tokens, steps drafting or probing, all steps (0s without speculation)
  curl -sf "$1/metrics" | awk '/^jaxserve:spec_decode_num_draft_tokens_total/ {d=$2}
    /^jaxserve:spec_decode_num_accepted_tokens_total/ {a=$2}
    /^jaxserve:spec_decode_steps_total\{outcome="(drafting|probe)"\}/ {on+=$2}
    /^jaxserve:spec_decode_steps_total\{/ {all+=$2}
    END {printf "%d %d %d %d\n", d, a, on, all}'
}

stack_url() { case $1 in jaxserve-off) echo http://127.0.0.1:8322 ;; jaxserve-ngram) echo http://127.0.0.1:8323 ;;
  *) echo "$URL" ;; esac; }

load() { # model stack workload round: each level, one JSON line (llama-server; jaxserve: load_pair)
  local model=$1 stack=$2 kind=$3 round=$4 dir url; dir=$(model_dir "$1"); url=$(stack_url "$2")
  for c in ${CONC//,/ }; do
    local n; n=$(requests "$model" "$c")
    local data=(--dataset-name jsonl --dataset-path "$WORK/$model-$kind.jsonl")
    if [ "$kind" = random ]; then
      data=(--dataset-name random --tokenizer "$dir" --random-input-len "$(prompt_len "$model")"
            --random-output-len 64 --random-prompt-form ids)
    fi
    read -r d0 a0 on0 all0 < <(spec_counters "$url")
    $JX bench serve --base-url "$url" --model m "${data[@]}" --num-prompts "$n" --max-concurrency "$c" \
      --ignore-eos --temperature 0 --num-warmups 1 --no-progress --save-result "$WORK/level.json" > /dev/null \
      || return 1
    read -r d1 a1 on1 all1 < <(spec_counters "$url")
    "$PY" - "$WORK/level.json" "$model" "$stack" "$kind" "$c" "$round" "$((d1 - d0))" "$((a1 - a0))" \
      "$((on1 - on0))" "$((all1 - all0))" <<'PY' | tee -a "$OUT"
import json, sys
path, model, stack, kind, c, round_, drafted, accepted, on, steps = sys.argv[1:]
m = json.load(open(path))["levels"][0]["metrics"]
print(json.dumps({"bench": "speculative-served", "model": model, "stack": stack, "workload": kind,
                  "concurrency": int(c), "round": int(round_), "requests": m["completed"], "failed": m["failed"],
                  "output_tok_s": round(m["output_throughput"], 1), "draft_tokens": int(drafted),
                  "accepted_tokens": int(accepted), "steps_drafting": int(on), "steps": int(steps)}))
PY
  done
}

load_pair() { # model workload round concurrency first (0: off, 1: ngram): both servers' JSON lines for the level
  local model=$1 kind=$2 c=$4 dir n off ngram; dir=$(model_dir "$1"); n=$(requests "$model" "$c")
  off=$(stack_url jaxserve-off); ngram=$(stack_url jaxserve-ngram)
  local data=(--dataset-path "$WORK/$model-$kind.jsonl")
  [ "$kind" = random ] && data=(--random-input-len "$(prompt_len "$model")" --tokenizer "$dir")
  read -r d0 a0 on0 all0 < <(spec_counters "$ngram")
  "$PY" benchmarks/served_pair.py --urls "$off" "$ngram" --model m "${data[@]}" --num-prompts "$n" \
    --max-concurrency "$c" --first "$5" --save-result "$WORK/pair.json" > /dev/null || return 1
  read -r d1 a1 on1 all1 < <(spec_counters "$ngram")
  "$PY" - "$WORK/pair.json" "$model" "$kind" "$3" "$((d1 - d0))" "$((a1 - a0))" "$((on1 - on0))" \
    "$((all1 - all0))" <<'PY' | tee -a "$OUT"
import json, sys
path, model, kind, round_, drafted, accepted, on, steps = sys.argv[1:]
pair = json.load(open(path))
for stack, server in zip(("jaxserve-off", "jaxserve-ngram"), pair["servers"]):
    ngram = stack == "jaxserve-ngram"
    print(json.dumps({"bench": "speculative-served", "model": model, "stack": stack, "workload": kind,
                      "concurrency": pair["concurrency"], "round": int(round_), "requests": pair["requests"],
                      "failed": server["failed"], "output_tok_s": server["output_tok_s"], "chunks": pair["chunks"],
                      "first": ("jaxserve-off", "jaxserve-ngram")[pair["first"]], "chunk_tok_s": server["chunk_tok_s"],
                      "draft_tokens": int(drafted) if ngram else 0, "accepted_tokens": int(accepted) if ngram else 0,
                      "steps_drafting": int(on) if ngram else 0, "steps": int(steps) if ngram else 0}))
PY
}

serve_jaxserve() { # stack model: start it and wait until it is ready; its pid in pids[stack]
  local spec=() url; url=$(stack_url "$1"); [ "$1" = jaxserve-ngram ] && [ "$NGRAM" != none ] && spec=(--speculative-config "$NGRAM")
  $JX serve --model "$(model_dir "$2")" --max-num-seqs 16 --max-model-len "$(max_len "$2")" --host 127.0.0.1 \
    --port "${url##*:}" --served-model-name m --warmup full "${spec[@]}" > "$PR/logs/$1-$2.log" 2>&1 &
  pids[$1]=$!
  wait_health "$url" 900 "${pids[$1]}" || { echo "server failed: see $PR/logs/$1-$2.log" >&2; exit 1; }
}
declare -A pids
stop_servers() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; pids=(); }
trap 'stop_servers; rm -rf "$WORK"' EXIT

for model in $MODELS; do
  dir=$(model_dir "$model")
  [ -d "$dir" ] || { echo "no $dir: run ../shared/peers/setup.sh once" >&2; exit 1; }
  most=1; for c in ${CONC//,/ }; do n=$(requests "$model" "$c"); [ "$n" -gt "$most" ] && most=$n; done
  for kind in $WORKLOADS; do  # as many distinct prompts as the longest level sends, and its warm-up
    [ "$kind" = random ] && continue
    "$PY" benchmarks/speculative.py --model "$dir" --write-prompts "$WORK/$model-$kind.jsonl" \
      --workload "$kind" --requests $((most + 1)) 2>/dev/null || exit 1
  done
  if [ "$LLAMA_SERVER" = 1 ]; then
    "$LS" -m "$PR/models/gguf/$model-f32.gguf" --host 127.0.0.1 --port $PORT -c 16384 --parallel 16 \
      --cont-batching -t "$(nproc)" -tb "$(nproc)" > "$PR/logs/llama-server-spec.log" 2>&1 &
    pid=$!; wait_health "$URL" 600 $pid || { echo "server failed: see $PR/logs" >&2; exit 1; }
    for kind in $WORKLOADS; do load "$model" llama-server "$kind" 1; done
    kill $pid; wait $pid 2>/dev/null
  fi
  for round in $(seq 1 "$ROUNDS"); do
    # Fresh servers each round, the one started first alternating: the server started second served 2% faster
    # than the first in an A/A run with off first (all nine stories260K levels 1.02x), and 1-5% slower with
    # the order swapped, so a fixed order biases every level; over two rounds the bias cancels.
    if [ $((round % 2)) = 1 ]; then serve_jaxserve jaxserve-off "$model"; serve_jaxserve jaxserve-ngram "$model"
    else serve_jaxserve jaxserve-ngram "$model"; serve_jaxserve jaxserve-off "$model"; fi
    pair=0  # a level's pair starts with off in odd rounds where the level before started with ngram
    for kind in $WORKLOADS; do
      for c in ${CONC//,/ }; do
        load_pair "$model" "$kind" "$round" "$c" $(((pair + round + 1) % 2)) || exit 1
        pair=$((pair + 1))
      done
    done
    stop_servers
  done
done

"$PY" benchmarks/speculative.py --summarize "$OUT"
settings=$(env | grep -E '^(MODELS|WORKLOADS|CONC|ROUNDS|LLAMA_SERVER|REQUESTS|SPEC_CONFIG)=' | sed "s/=\(.*\)/='\1'/" | tr '\n' ' ')
echo "Reproduce: ${settings}benchmarks/speculative_vs_llama_cpp.sh $OUT"
