# Shell helpers the served benchmarks share: `source benchmarks/lib.sh` (or "$(dirname "$0")/lib.sh").

# wait_health URL [SECONDS] [PID]: poll URL/health once a second until it answers 200 (default: 600 s);
# returns 1 if it never does, or at once when the server process PID has exited (a refused flag).
wait_health() {
  for _ in $(seq 1 "${2:-600}"); do
    curl -sf "$1/health" >/dev/null && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then return 1; fi
    sleep 1
  done
  return 1
}
