#!/usr/bin/env bash
# `make test` from a fresh clone of this checkout's HEAD, beside one other job that loads both cores: the figures
# of docs/install.md's table "beside another job".
#
#   benchmarks/suite_beside_load.sh            # beside two busy loops, one per core
#   benchmarks/suite_beside_load.sh --demo     # beside `make demo` (horovodrun -np 2) training for 1,000 epochs
#   benchmarks/suite_beside_load.sh --quiet    # the reference: nothing else started
#
# The load is one job in a session of its own, started before the clone and ended by its process group when the
# run ends, however it ends (a training's ranks end with their horovodrun). The clone is made in a temporary folder
# and removed afterwards (the run's log is kept, its path printed); the Horovod wheel cache (~/.cache/pksampler) is
# shared, as on CI. Prints the set-up's and the whole run's wall time and the suite's summary line; exits with
# `make test`'s status.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[[ $# -le 1 ]] || { echo "usage: $0 [--demo | --quiet]  (got: $*)" >&2; exit 2; }
case "${1:-}" in
    "") load=busy ;;
    --demo) load=demo ;;
    --quiet) load=none ;;
    *) echo "usage: $0 [--demo | --quiet]  (got: $1)" >&2; exit 2 ;;
esac

work="$(mktemp -d "${TMPDIR:-/tmp}/pksampler-suite.XXXXXX")"
log="$(mktemp "${TMPDIR:-/tmp}/pksampler-suite-log.XXXXXX")"
loader=""
cleanup() {
    [[ -n "$loader" ]] && kill -- "-$loader" 2>/dev/null || true
    rm -rf "$work" || true   # a training's last write may land while it is being removed
}
trap cleanup EXIT

if [[ "$load" == busy ]]; then
    setsid bash -c 'python3 -c "while True: pass" & python3 -c "while True: pass" & wait' >/dev/null 2>&1 &
    loader=$!
    echo "[suite] load: two busy loops in session $loader"
elif [[ "$load" == demo ]]; then
    setsid make -C "$ROOT" demo ARGS="--set train.epochs=1000 --set workspace=$work/demo" >"$log.demo" 2>&1 &
    loader=$!
    echo "[suite] load: make demo (horovodrun -np 2) in session $loader, its log $log.demo"
fi
git clone -q "$ROOT" "$work/clone"
echo "[suite] make test in a fresh clone of $(git -C "$ROOT" rev-parse --short HEAD) ($work/clone)"
start=$(date +%s)
status=0
(cd "$work/clone" && make test) >"$log" 2>&1 || status=$?
total=$(( $(date +%s) - start ))
if [[ -n "$loader" ]] && ! kill -0 -- "-$loader" 2>/dev/null; then
    echo "[suite] warning: the load ended before the suite did (see $log.demo for a training's output)" >&2
fi
grep -E "set-up finished|launches:" "$log" || true
tail -n 1 "$log"
echo "[suite] log: $log"
echo "[suite] make test $([[ "$load" == none ]] && echo "quiet" || echo "beside the load ($load)"):" \
     "$((total / 60)) min $((total % 60)) s, exit status $status"
exit "$status"
