#!/usr/bin/env bash
# `make test` from a fresh clone of this checkout's HEAD, beside one other job that loads both cores, the way
# docs/install.md's figures were measured.
#
#   benchmarks/suite_beside_load.sh            # beside the load: two busy loops in one session of their own
#   benchmarks/suite_beside_load.sh --quiet    # the reference: nothing else started
#
# The load is one job as the scheduler counts jobs (Linux groups a session's processes when it shares the cores
# out: sched_autogroup): two Python busy loops, one per core, in a session of their own, started before the clone
# and ended by their process group when the run ends, however it ends. The clone is made in a temporary folder and
# removed afterwards (the run's log is kept, its path printed); the Horovod wheel cache (~/.cache/pksampler) is
# shared, as on CI. Prints the set-up's and the whole run's wall time and the suite's summary line; exits with
# `make test`'s status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
    "") load=1 ;;
    --quiet) load=0 ;;
    *) echo "usage: $0 [--quiet]  (got: $1)" >&2; exit 2 ;;
esac

work="$(mktemp -d "${TMPDIR:-/tmp}/pksampler-suite.XXXXXX")"
log="$(mktemp "${TMPDIR:-/tmp}/pksampler-suite-log.XXXXXX")"
loader=""
cleanup() {
    [[ -n "$loader" ]] && kill -- "-$loader" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

if [[ "$load" == 1 ]]; then
    setsid bash -c 'python3 -c "while True: pass" & python3 -c "while True: pass" & wait' >/dev/null 2>&1 &
    loader=$!
    echo "[suite] load: two busy loops in session $loader"
fi
git clone -q "$ROOT" "$work/clone"
echo "[suite] make test in a fresh clone of $(git -C "$ROOT" rev-parse --short HEAD) ($work/clone)"
start=$(date +%s)
status=0
(cd "$work/clone" && make test) >"$log" 2>&1 || status=$?
total=$(( $(date +%s) - start ))
grep -E "set-up finished|launches:" "$log" || true
tail -n 1 "$log"
echo "[suite] log: $log"
echo "[suite] make test $([[ "$load" == 1 ]] && echo "beside the load" || echo "quiet"):" \
     "$((total / 60)) min $((total % 60)) s, exit status $status"
exit "$status"
