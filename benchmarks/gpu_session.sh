#!/usr/bin/env bash
# One device call's worth of GPU checks, in order of what matters most, under one overall deadline so the
# call returns before its timeout (METHOD.md: one prepared script, a table last, details under $OUT):
#   1. kernels: the Triton kernel's correctness checks, then decode / prefill / mixed timings;
#   2. e2e8: the engine end to end in bf16 on an 8-layer Llama-3-8B-shaped model (greedy check first), its
#      1- and 16-sequence decode steps profiled (where the time goes);
#   3. spec8: the same with n-gram drafts of up to 4 tokens (issue 26 on the device);
#   4-5. moe8 / dense8a: Qwen3-30B-A3B's shape at 8 layers (128 experts, top 8, ragged_dot) and a dense
#      model of its active size (issue 29's step cost);
#   6. exact8: one-token decode steps, not padded to 16, profiled (is the extra time the host's?);
#   7. long8: 8192-token contexts with the kernel's default split keys, greedy-checked over long prompts.
#   Also, when GPU_PARTS names them (measured in the leases so far, docs/performance.md): split8 (4 splits
#   of every context), int8wo (int8 weights run weight-only), int8 / fp8 (int8 / fp8 weights and KV pages,
#   dynamic activations), scan8 (layers scanned), long8x1 (long8 unsplit), e2e32 (all 32 layers).
# The e2e parts check greedy tokens in bf16 only; the kernels part checks float32 kernels (the e2e float32
# check adds ~40 s: run gpu_kernels.py --sections e2e alone for it).
# Each part is its own process with its own timeout, so one hang or crash costs only that part.
#   bash benchmarks/gpu_session.sh     # what the first call of a lease runs (DEADLINE=540: timeout_s 570)
#   GPU_PARTS="scan8 e2e32" DEADLINE=400 bash benchmarks/gpu_session.sh
#   GPU_EXTRA_ARGS="--interpret --e2e-tiny ..." appends flags to every part (a CPU dry run: tests/test_benchmarks.py)
# Writes $OUT/session.log and $OUT/<part>/gpu_kernels.json (at most 8 files come back from a call).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
DEADLINE=${DEADLINE:-540}
PARTS=${GPU_PARTS:-"kernels e2e8 spec8 moe8 dense8a exact8 long8"}
START=$SECONDS
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1

echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git); parts: $PARTS; deadline ${DEADLINE}s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true
python3 -c 'import jax, flax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__, jax.devices())'

E2E8="--sections e2e --skip-checks --e2e-layers 8 --e2e-check-dtypes bfloat16"
A3B="--e2e-hidden 2048 --e2e-heads 32 --e2e-kv-heads 4 --e2e-vocab 151936"  # Qwen3-30B-A3B's attention and vocabulary
part_args() {
  case $1 in
    kernels) echo "--sections decode prefill mixed" ;;
    e2e8)    echo "$E2E8" ;;
    int8)    echo "$E2E8 --e2e-quantization int8 --e2e-kv-cache-dtype int8" ;;
    int8wo)  echo "$E2E8 --e2e-quantization int8 --e2e-quantization-strategy weight_only" ;;
    fp8)     echo "$E2E8 --e2e-quantization fp8 --e2e-kv-cache-dtype fp8" ;;
    scan8)   echo "$E2E8 --e2e-layer-loop scan" ;;
    exact8)  echo "$E2E8 --e2e-exact-buckets --e2e-decode-batches 1 16" ;;
    split8)  echo "$E2E8 --e2e-kv-splits 4" ;;
    spec8)   echo "$E2E8 --e2e-decode-batches 1 16 --e2e-ngram 4" ;;
    moe8)    echo "$E2E8 $A3B --e2e-experts 128 --e2e-experts-per-token 8 --e2e-moe-intermediate 768" ;;
    dense8a) echo "$E2E8 $A3B --e2e-intermediate 6144" ;;
    long8)   echo "$E2E8 --e2e-context 8192 --e2e-decode-batches 1 16 --e2e-check-prompts 1500 37 2100" ;;
    long8x1) echo "$E2E8 --e2e-context 8192 --e2e-decode-batches 1 16 --e2e-kv-splits 1 --e2e-check-dtypes" ;;
    e2e32)   echo "--sections e2e --skip-checks --e2e-check-dtypes bfloat16" ;;
    *) echo "unknown part $1" >&2; return 1 ;;
  esac
}
part_limit() {  # seconds one part may take, before the overall deadline cuts it shorter
  case $1 in kernels) echo 170 ;; fp8) echo 150 ;; e2e32) echo 280 ;; *) echo 120 ;; esac
}

for part in $PARTS; do
  left=$((DEADLINE - (SECONDS - START)))
  limit=$(part_limit "$part"); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 40 ]; then echo "== $part: skipped, ${left}s left"; continue; fi
  args=$(part_args "$part") || continue
  echo "== $part (limit ${limit}s): python3 benchmarks/gpu_kernels.py $args"
  # The script's own --time-budget ends its parts gracefully (the table still prints) a little before the
  # hard timeout.
  OUT="$OUT/$part" timeout --kill-after=5 "$limit" \
    python3 benchmarks/gpu_kernels.py $args --time-budget $((limit - 15)) ${GPU_EXTRA_ARGS:-}
  echo "== $part: exit $?, $((SECONDS - START))s in"
done
echo "== done in $((SECONDS - START))s"
