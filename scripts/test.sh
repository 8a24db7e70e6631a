#!/usr/bin/env bash
# The test suite: lint, then pytest. pytest's exit 5 (no tests collected) is a failure here.
#   bash scripts/test.sh           the whole suite (CI runs this)
#   bash scripts/test.sh --fast    the fast tier, for while you work: every test not marked slow
# Other arguments go to pytest (a file, -k EXPR, -x, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
args=()
fast=0
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then fast=1; args+=(-m "not slow"); else args+=("$arg"); fi
done
ruff check polyrl tests benchmarks || exit 1
# The rollout viewer's browser test (slow tier) drives Debian's Chromium: installed here when missing (as root),
# else a clear stop, so that the test always runs (a skipped check is not a passed one).
chromium="${POLYRL_CHROMIUM:-/usr/bin/chromium}"
if [ "$fast" -eq 0 ] && ! { [ -x "$chromium" ] || command -v "$chromium" >/dev/null 2>&1; }; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium for the viewer's browser test" >&2
    { apt-get update -qq && apt-get install -y -qq chromium; } >/dev/null || exit 1
  else
    echo "the viewer's browser test needs Chromium: sudo apt-get install -y chromium (Debian), or set" \
         "POLYRL_CHROMIUM to a Chromium binary" >&2
    exit 1
  fi
fi
# Two workers (pytest-xdist), each given whole modules so that module fixtures are built once, in collection
# order: tests/conftest.py puts the longest modules first (xdist's own order, most tests first, would start
# long modules of few tests last). POLYRL_TEST_WORKERS=0 runs everything in this process. The 15 slowest tests
# are listed at the end.
python -m pytest tests -n "${POLYRL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 \
  "${args[@]}"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
