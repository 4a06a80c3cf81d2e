#!/usr/bin/env bash
# Run the whole suite: unit tests, hypothesis property tests and the real
# multi-process tests under horovodrun -np 2. Exit code 5 (no tests collected)
# counts as a failure.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh" || exit 1
cd "$ROOT"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-ci}"
"$ROOT/.venv/bin/python" -m pytest "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
