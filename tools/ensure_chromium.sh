#!/usr/bin/env bash
# Make sure Debian's Chromium is at /usr/bin/chromium for the playground's browser test
# (tests/test_playground.py drives it with the `playwright` package; Playwright's own browser download
# is not used). Called by `./dev test` and `.ci/run`.
#   tools/ensure_chromium.sh             install it if missing and possible (root with apt-get), else say
#                                        in one line why not; exits 0 either way, so the test then skips
#   tools/ensure_chromium.sh --required  the same, but exit 1 when Chromium cannot be had (CI)
# Prints how long an install took (about 45 s on a fresh Debian 12 machine).
set -uo pipefail

chromium="${JAXSERVE_CHROMIUM:-/usr/bin/chromium}"
required=0
[ "${1:-}" = "--required" ] && required=1

[ -x "$chromium" ] && exit 0

give_up() {
  echo "ensure_chromium: $1; the playground browser test will skip" >&2
  exit $((required))
}

[ "$chromium" = /usr/bin/chromium ] || give_up "no Chromium at JAXSERVE_CHROMIUM=$chromium"
command -v apt-get >/dev/null || give_up "no Chromium at $chromium and no apt-get to install it"
[ "$(id -u)" = 0 ] || give_up "no Chromium at $chromium; install it with: sudo apt-get install chromium"

echo "ensure_chromium: installing Debian's chromium for the playground browser test ..." >&2
start=$SECONDS
log=$(mktemp)
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o DPkg::Lock::Timeout=300 chromium >>"$log" 2>&1
}
# The package lists may be missing or stale on a fresh machine: refresh them only when the install fails.
if ! apt_install && ! { apt-get update -q >>"$log" 2>&1 && apt_install; }; then
  tail -n 20 "$log" >&2
  rm -f "$log"
  give_up "apt-get install chromium failed (log above)"
fi
rm -f "$log"
echo "ensure_chromium: installed $("$chromium" --version 2>/dev/null) in $((SECONDS - start)) s" >&2
