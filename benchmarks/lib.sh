# Shell helpers the served benchmarks share: `source benchmarks/lib.sh` (or "$(dirname "$0")/lib.sh").

# wait_health URL [SECONDS]: poll URL/health once a second until it answers 200 (default: 600 s);
# returns 1 if it never does.
wait_health() {
  for _ in $(seq 1 "${2:-600}"); do curl -sf "$1/health" >/dev/null && return 0; sleep 1; done
  return 1
}
