#!/usr/bin/env bash
# One device call's worth of GPU checks, the decisive ones first (issue 52, item 4), under one overall
# deadline so the call returns before its timeout (METHOD.md: one prepared script, a table last, details
# under $OUT). The default parts, 8-layer models of Llama-3-8B's shape unless named otherwise:
#   1. e2e8: bf16, greedy-checked against the reference first; decode steps at 1 / 16 / 64 sequences, each
#      profiled (the device's busy time against the wall time, its busiest kernels);
#   2-3. int8x / int8p: int8 weight-only, its products forced to XLA's / to the Pallas kernels
#      (--quantized-matmul xla|pallas), profiled at 1 and 16 sequences;
#   4. spec8: n-gram drafts of up to 4 tokens (K = 4): its steps verify 5 tokens a sequence where the
#      drafts come, against e2e8's one-token steps; profiled at one sequence;
#   5-6. moe8 / dense8a: Qwen3-30B-A3B's shape at 8 layers (128 experts, top 8, ragged_dot) and a dense
#      model of its active size (issue 29's step cost);
#   7. qmm: the weight-only int8 kernels against XLA's products on Llama-3-8B's five shapes (checked
#      against the reference on the device first), if time is left.
#   Also, when GPU_PARTS names them (measured in the leases so far, docs/performance.md): kernels (the
#   attention kernel's checks and timings), exact8 (unpadded one-token steps), long8 / long8x1 (8192-token
#   contexts, split and unsplit keys), split8, int8wo (weight-only, the engine's own choice of products),
#   int8 / fp8 (int8 / fp8 weights and KV pages, dynamic activations), scan8, e2e32 (all 32 layers).
# Every engine part dumps XLA's autotuning results (which GEMM tiles and backend it picked on this GPU);
# they are merged into $OUT/autotune_<chip>.txt for the static profile to load without the device
# (benchmarks/autotune/README.md). Each part is its own process with its own timeout, so one hang or
# crash costs only that part; after each, gpu_session_summary.py merges what the parts wrote into
# $OUT/session.json, and at the end it prints the table of the issue's targets.
#   bash benchmarks/gpu_session.sh     # what the first call of a lease runs (DEADLINE=540: timeout_s 580)
#   GPU_PARTS="kernels exact8" DEADLINE=300 bash benchmarks/gpu_session.sh
#   GPU_EXTRA_ARGS="--interpret --e2e-tiny ..." appends flags to every engine part, GPU_QMM_ARGS to qmm's
#   (a CPU dry run: tests/test_benchmarks.py)
# Comes back (at most 8 files from a call): $OUT/session.log, $OUT/session.json, $OUT/autotune_<chip>.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
DEADLINE=${DEADLINE:-540}
PARTS=${GPU_PARTS:-"e2e8 int8x int8p spec8 moe8 dense8a qmm"}
START=$SECONDS
mkdir -p "$OUT"
WORK=$(mktemp -d)  # each part's JSON and autotuning dump; only the merged files go under $OUT
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git); parts: $PARTS; deadline ${DEADLINE}s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c 'import jax, flax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, jax.devices())'

E2E8="--sections e2e --skip-checks --e2e-layers 8 --e2e-check-dtypes bfloat16"
FAST="--sections e2e --skip-checks --e2e-layers 8 --e2e-check-dtypes"  # e2e8 checked the attention kernel
INT8="$FAST --e2e-quantization int8 --e2e-quantization-strategy weight_only"
A3B="--e2e-hidden 2048 --e2e-heads 32 --e2e-kv-heads 4 --e2e-vocab 151936"  # Qwen3-30B-A3B's attention and vocabulary
part_args() {
  case $1 in
    kernels) echo "--sections decode prefill mixed" ;;
    e2e8)    echo "$E2E8 --e2e-profile-batches 1 16 64" ;;
    int8x)   echo "$INT8 --e2e-quantized-matmul xla" ;;
    int8p)   echo "$INT8 --e2e-quantized-matmul pallas" ;;
    int8wo)  echo "$INT8" ;;
    int8)    echo "$E2E8 --e2e-quantization int8 --e2e-quantization-strategy dynamic_int8 --e2e-kv-cache-dtype int8" ;;
    fp8)     echo "$E2E8 --e2e-quantization fp8 --e2e-kv-cache-dtype fp8" ;;
    scan8)   echo "$E2E8 --e2e-layer-loop scan" ;;
    exact8)  echo "$E2E8 --e2e-exact-buckets --e2e-decode-batches 1 16" ;;
    split8)  echo "$E2E8 --e2e-kv-splits 4" ;;
    spec8)   echo "$FAST --e2e-decode-batches 1 16 --e2e-ngram 4 --e2e-profile-batches 1" ;;
    moe8)    echo "$FAST $A3B --e2e-experts 128 --e2e-experts-per-token 8 --e2e-moe-intermediate 768" ;;
    dense8a) echo "$FAST $A3B --e2e-intermediate 6144" ;;
    long8)   echo "$E2E8 --e2e-context 8192 --e2e-decode-batches 1 16 --e2e-check-prompts 1500 37 2100" ;;
    long8x1) echo "$E2E8 --e2e-context 8192 --e2e-decode-batches 1 16 --e2e-kv-splits 1 --e2e-check-dtypes" ;;
    e2e32)   echo "--sections e2e --skip-checks --e2e-check-dtypes bfloat16" ;;
    qmm)     echo "--codes int8 --rows 16 64" ;;  # a lone decode runs padded to 16 rows
    *) echo "unknown part $1" >&2; return 1 ;;
  esac
}
part_limit() {  # seconds one part may take, before the overall deadline cuts it shorter
  # e2e8's greedy check (10-30 s) comes before its build, which gpu_engine_step.build_reserve_s (68 s at 8
  # layers) must still find time for under --time-budget (the cap less 15 s)
  case $1 in kernels) echo 170 ;; fp8) echo 150 ;; e2e32) echo 280 ;; e2e8) echo 130 ;; int8p|moe8) echo 110 ;;
             qmm) echo 80 ;; *) echo 100 ;; esac
}

KNOWN=""
for part in $PARTS; do part_args "$part" >/dev/null && KNOWN="$KNOWN $part"; done  # named at once, not at its turn

for part in $KNOWN; do
  left=$((DEADLINE - (SECONDS - START)))
  limit=$(part_limit "$part"); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "== $part: skipped, ${left}s left"; continue; fi
  args=$(part_args "$part")
  mkdir -p "$WORK/$part"
  if [ "$part" = qmm ]; then
    command="python3 benchmarks/quantized_matmul_kernels.py $args --json $WORK/$part/rows.json ${GPU_QMM_ARGS:-}"
  else
    # The script's own --time-budget ends its sections gracefully (its table still prints) a little before
    # the hard timeout.
    command="python3 benchmarks/gpu_kernels.py $args --time-budget $((limit - 15)) ${GPU_EXTRA_ARGS:-}"
  fi
  echo "== $part (limit ${limit}s): $command"
  OUT="$WORK/$part" XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_dump_autotune_results_to=$WORK/$part/autotune.txt" \
    timeout --kill-after=5 "$limit" $command
  echo "== $part: exit $?, $((SECONDS - START))s in"
  python3 benchmarks/gpu_session_summary.py "$WORK" "$OUT" --parts $KNOWN --quiet \
    || echo "== merging the parts' files failed"
done
echo "== done in $((SECONDS - START))s"
python3 benchmarks/gpu_session_summary.py "$WORK" "$OUT" --parts $KNOWN
