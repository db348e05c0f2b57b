#!/usr/bin/env bash
# Issue 29's MoE benchmark, one run: a random Qwen3-MoE-shaped model (64 experts, top 8, ~0.95B total,
# ~0.25B active) served by llama-server (its f32 GGUF conversion) and by `jaxserve serve`, output tok/s at
# concurrency 1 and 16 (prompt 128, 64 tokens out), and jaxserve serving the dense model of the active
# size under the same load (a decode step of the MoE should cost at most 2x the dense one's).
# Needs ../shared/peers/setup.sh (llama-server, the converter, llama110m-random's tokenizer). Run it only
# on a quiet machine (`uptime` load below 2.5) and record the table with this command in docs/models.md.
#   benchmarks/moe_vs_llama_cpp.sh [OUT.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}
OUT=${1:-$PR/results/moe_vs_llama_cpp-$(date +%Y%m%d-%H%M%S).jsonl}
PP=$PR/venv/bin/python; LS=$PR/build-native/bin/llama-server
SRC=${LLAMACPP_SRC:-$(ls -d "$PR"/src/llama_cpp_python-*/vendor/llama.cpp | tail -1)}
TOK=$PR/models/llama110m-random; MOE=$PR/models/qwen3moe-random; DENSE=$PR/models/qwen3-dense-active
GGUF=$PR/models/gguf/qwen3moe-random-f32.gguf
CONC=${CONC:-1,16}
./dev run true
[ -d "$MOE" ] || .venv/bin/python benchmarks/make_random_moe.py --tokenizer "$TOK" --out "$MOE" --dense-out "$DENSE"
# The random model borrows llama110m-random's SentencePiece vocabulary, which the converter's Qwen MoE
# classes do not look for (they expect Qwen's BPE files): read it the way its Llama class does.
[ -f "$GGUF" ] || "$PP" - "$SRC" "$MOE" "$GGUF" <<'PY'
import runpy, sys
src, model, out = sys.argv[1:]
sys.path[:0] = [src, f"{src}/gguf-py"]
import conversion.qwen
conversion.qwen.Qwen3MoeModel.set_vocab = lambda self: self._set_vocab_sentencepiece()
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f32", "--outfile", out]
runpy.run_path(f"{src}/convert_hf_to_gguf.py", run_name="__main__")
PY
mkdir -p "$PR/logs" "$(dirname "$OUT")"
source benchmarks/lib.sh  # wait_health
load() { # url stack [load options]
  "$PP" ../shared/peers/load_bench.py --base-url "$1" --model m --tokenizer "$TOK" --prompt-len 128 --max-tokens 64 \
    --concurrency "$CONC" --stack "$2" --ignore-eos --out "$OUT" "${@:3}" 2>&1 | grep "done:"; }
"$LS" -m "$GGUF" --host 127.0.0.1 --port 8311 -c 16384 --parallel 16 --cont-batching -t "$(nproc)" \
  -tb "$(nproc)" > "$PR/logs/llama-server-8311.log" 2>&1 & P=$!
# --no-keepalive: as side_by_side.sh loads llama-server
wait_health http://127.0.0.1:8311 900 && load http://127.0.0.1:8311 llama-server --no-keepalive; kill $P; wait $P 2>/dev/null || true
for model in "$MOE:jaxserve-moe:8312" "$DENSE:jaxserve-dense-active:8313"; do
  IFS=: read -r dir stack port <<< "$model"
  .venv/bin/jaxserve serve --model "$dir" --max-num-seqs 16 --max-model-len 1024 --host 127.0.0.1 --port "$port" \
    --served-model-name m --warmup full > "$PR/logs/$stack-$port.log" 2>&1 & P=$!
  wait_health "http://127.0.0.1:$port" 900 && load "http://127.0.0.1:$port" "$stack"; kill $P; wait $P 2>/dev/null || true
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{") and '"bench"' in l]
tok_s = {(r["stack"], r["metrics"]["concurrency"]): r["metrics"]["output_throughput_tok_s"] for r in rows}
print("\n| concurrency | llama-server | jaxserve MoE | ratio (target) | jaxserve dense active-size | MoE / dense step |")
print("|---:|---:|---:|---:|---:|---:|")
for conc, target in ((1, 0.8), (16, 1.0)):
    ls, moe, dense = (tok_s.get((s, conc)) for s in ("llama-server", "jaxserve-moe", "jaxserve-dense-active"))
    if ls and moe and dense:
        print(f"| {conc} | {ls:.1f} | {moe:.1f} | {moe / ls:.2f}x (>= {target}x) | {dense:.1f} | "
              f"{dense / moe:.2f}x (<= 2x) |")
PY
echo "results: $OUT"
