#!/usr/bin/env bash
# The test suite: lint, then pytest. pytest's exit 5 (no tests collected) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
ruff check polyrl tests benchmarks || exit 1
python -m pytest tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
