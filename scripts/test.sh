#!/usr/bin/env bash
# Run the whole suite: unit tests, hypothesis property tests and the real
# multi-process tests under horovodrun -np 2, in the venv that scripts/setup.sh
# prepares for $PYTHON (default python3.11: .venv/; another version:
# .venv-3.X/). Exit code 5 (no tests collected) counts as a failure.
#
#   scripts/test.sh                          # Python 3.11, .venv/
#   PYTHON=python3.12 scripts/test.sh -x     # Python 3.12, .venv-3.12/, pytest -x
#   scripts/test.sh --fast                   # the edit loop's tier: every test that starts no launcher
#                                            # (horovodrun, torchrun, accelerate, Lightning) and no S3 server
#   PKSAMPLER_TEST_WORKERS=0 scripts/test.sh tests/x.py   # one process (pdb, -s); default: 2 xdist workers
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
workers="${PKSAMPLER_TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
    echo "PKSAMPLER_TEST_WORKERS=$workers: must be a whole number of xdist workers (0: none, one process)" >&2
    exit 2
fi
VENV="$("$ROOT/scripts/setup.sh" --print-venv)" || exit 1
"$ROOT/scripts/setup.sh" || exit 1
cd "$ROOT"
# CI's profile (tests/conftest.py) for the whole suite; the edit loop's tier runs the lighter `dev` one.
profile=ci
if [[ "${1:-}" == "--fast" ]]; then
    shift
    set -- -m "not launcher" "$@"
    profile=dev
fi
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-$profile}"
echo "[test] $("$VENV/bin/python" -c 'import sys; print("Python", sys.version.split()[0])') in $VENV," \
     "hypothesis profile $HYPOTHESIS_PROFILE" >&2
# The suite's processes write bytecode, whatever PYTHONDONTWRITEBYTECODE says outside: set-up compiled only what the
# trainer imports (its pip installs skip byte-compiling), so each other module (the test-only libraries, the
# reference code) is compiled by the first process that imports it rather than from source in each of the suite's
# ~300 processes. The project itself is byte-compiled here, once, before the ranks that import it start together
# (every folder of the import namespace, pyproject.toml's package-dir, and the tests' helpers); compileall writes
# __pycache__/ (ignored by git) and recompiles only what changed; a file that does not compile is left for pytest to
# report.
unset PYTHONDONTWRITEBYTECODE
"$VENV/bin/python" -m compileall -q pksampler samplers datasets train tests > /dev/null 2>&1 || true
# Two worker processes (pytest-xdist; PKSAMPLER_TEST_WORKERS=N for another count, 0 for none): a launched test
# spends much of its time starting ranks and waiting on collectives, so a second worker's tests fill those gaps.
# --dist loadfile keeps a test file on one worker: the launches its module fixtures share start once. Arguments
# that turn xdist off (-p no:xdist) get one process, as PKSAMPLER_TEST_WORKERS=0 does. Files are handed out in
# tests/conftest.py's order (longest first, in-process files last), not xdist's (most tests first).
parallel=()
if [[ "$((10#$workers))" -gt 0 && " $* " != *" -p no:xdist "* && " $* " != *" -pno:xdist "* ]]; then
    parallel=(-n "$((10#$workers))" --dist loadfile --no-loadscope-reorder)
fi
# --durations=25: the slowest tests, printed at the end of every run, so the suite's cost is a recorded fact;
# the session's summary also counts the launches (tests/launch.py).
"$VENV/bin/python" -m pytest "${parallel[@]}" --durations=25 "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit $rc
