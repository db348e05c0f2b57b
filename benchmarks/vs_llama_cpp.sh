#!/usr/bin/env bash
# jaxserve beside llama.cpp on this machine, in one run: the served load of ../shared/peers/side_by_side.sh
# (llama-server vs `jaxserve serve`, stories260K and the random 124.7M Llama, concurrency 1/4/16), then
# offline batch-1 decode (`LLM` with default settings vs llama-bench tg128), then one table of ratios
# against the targets of docs/performance.md. Needs ../shared/peers/setup.sh to have run once.
#   benchmarks/vs_llama_cpp.sh [OUT.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
PR=${PEERS_ROOT:-$HOME/.cache/jaxserve-peers}
OUT=${1:-$PR/results/vs_llama_cpp-$(date +%Y%m%d-%H%M%S).jsonl}
./dev run true  # make sure .venv exists and is current
# Steady-state comparison: the load starts at /health 200, so have it wait for every step program.
JAXSERVE_ARGS="--warmup full ${JAXSERVE_ARGS:-}" ../shared/peers/side_by_side.sh "$OUT"
./dev run python benchmarks/offline_decode.py --model "$PR/models/llama110m-random" \
  --llama-bench "$PR/build-native/bin/llama-bench" --gguf "$PR/models/gguf/llama110m-random-f32.gguf" \
  | tee >(grep '^{' >> "$OUT")
.venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
serve = {}
for r in rows:
    if r.get("bench") == "serve":
        m = r["metrics"]
        model = "stories260K" if r["base_url"][-4:] in ("8301", "8302") else "llama110m-random"
        serve[(model, m["concurrency"], r["stack"])] = m
offline = {r["stack"]: r["tok_s"] for r in rows if r.get("n_gen") == 128 and r.get("n_prompt", 0) == 0}
targets = {("llama110m-random", 16): 1.5, ("llama110m-random", 1): 1.0, ("stories260K", 16): 2.0}
print("\n| what | llama.cpp | jaxserve | ratio | target |")
print("|---|---:|---:|---:|---|")
for (model, conc, stack), ls in sorted(serve.items()):
    jx = serve.get((model, conc, "jaxserve"))
    if stack != "llama-server" or not jx:
        continue
    ratio = jx["output_throughput_tok_s"] / ls["output_throughput_tok_s"]
    goal = targets.get((model, conc))
    print(f"| {model} served, concurrency {conc}, out tok/s | {ls['output_throughput_tok_s']:.1f} | "
          f"{jx['output_throughput_tok_s']:.1f} | {ratio:.2f}x | {f'>= {goal}x' if goal else ''} |")
    if (model, conc) == ("stories260K", 1):
        print(f"| stories260K ITL p50 at concurrency 1, ms | {ls['itl_ms']['p50']:.2f} | {jx['itl_ms']['p50']:.2f} | "
              f"| jaxserve <= 1 ms |")
if "jaxserve-offline" in offline and "llama-bench" in offline:
    ours, theirs = offline["jaxserve-offline"], offline["llama-bench"]
    print(f"| llama110m-random offline batch-1 decode tok/s (llama-bench tg128) | {theirs:.1f} | {ours:.1f} | "
          f"{ours / theirs:.2f}x | >= 1.0x |")
PY
echo "results: $OUT"
