#!/usr/bin/env bash
# One set-up path for `make demo` and `make test`.
#
# 1. creates .venv/ at the repository root if it is missing;
# 2. installs torch==2.13.0 first (the CPU wheel; an unpinned torch would pull
#    the multi-GB CUDA build), then this project in editable mode with extras;
# 3. builds Horovod 0.28.1 from its PyPI sdist with PyTorch + Gloo only (no MPI,
#    TensorFlow or MXNet), patched from C++14 to C++17 (torch >= 2.1 needs it),
#    and caches the wheel outside the clone so the next set-up takes seconds;
# 4. fails loudly unless `horovodrun --check-build` lists PyTorch and Gloo.
#
# A stamp in .venv/ records the inputs of a finished set-up; re-running on a
# ready machine only compares the stamp and exits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PKSAMPLER_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
TORCH_VERSION="2.13.0"
HOROVOD_VERSION="0.28.1"
CACHE_DIR="${PKSAMPLER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pksampler}"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

stamp_inputs() {
    cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"
    "$PYTHON" -c 'import sys; print(sys.version)'
    echo "torch=$TORCH_VERSION horovod=$HOROVOD_VERSION"
}
STAMP_WANT="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
STAMP_FILE="$VENV/.pksampler-setup-stamp"

if [[ -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP_WANT" && -x "$VENV/bin/horovodrun" ]]; then
    log "environment is up to date ($VENV)"
    exit 0
fi

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)

"${PIP[@]}" install -q --upgrade "pip>=23.2" "setuptools>=77" wheel
log "installing torch==$TORCH_VERSION (CPU)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
log "installing pksampler (editable) with dev extras"
"${PIP[@]}" install -q -e "$ROOT[dev]"
"$PY" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$TORCH_VERSION' else 'torch %s was installed instead of $TORCH_VERSION' % torch.__version__)"

# --- Horovod ----------------------------------------------------------------
PYTAG="$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')"
ARCH="$(uname -m)"
WHEEL_DIR="$CACHE_DIR/wheels/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG-$ARCH-gloo"
mkdir -p "$WHEEL_DIR"
WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)"

if [[ -z "$WHEEL" ]]; then
    log "building Horovod $HOROVOD_VERSION from the PyPI sdist (takes a few minutes)"
    if ! command -v cmake >/dev/null 2>&1; then
        log "no cmake on PATH; installing cmake<4 into the venv"
        "${PIP[@]}" install -q "cmake>=3.13,<4"
        export PATH="$VENV/bin:$PATH"
    fi
    BUILD="$(mktemp -d "${TMPDIR:-/tmp}/pksampler-horovod.XXXXXX")"
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
        grep -q 'CMAKE_CXX_STANDARD 14' "$f" || die "C++ standard line not found in $f"
        sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$f"
    done
    "${PIP[@]}" install -q psutil cloudpickle pyyaml packaging
    (
        cd "$SRC"
        export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
            HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            HOROVOD_CPU_OPERATIONS=gloo CMAKE_POLICY_VERSION_MINIMUM=3.5 \
            MAKEFLAGS="-j$(nproc)"
        "${PIP[@]}" wheel -q --no-build-isolation --no-deps -w "$BUILD/dist" . \
            || die "Horovod build failed (see the compiler output above)"
    )
    cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/.tmp.whl"
    WHEEL="$WHEEL_DIR/$(basename "$BUILD"/dist/horovod-*.whl)"
    mv "$WHEEL_DIR/.tmp.whl" "$WHEEL"   # atomic: a half-copied wheel is never cached
    log "cached $WHEEL"
else
    log "using cached Horovod wheel $WHEEL"
fi
"${PIP[@]}" install -q "$WHEEL"

CHECK="$("$VENV/bin/horovodrun" --check-build 2>&1)" || die "horovodrun --check-build failed: $CHECK"
grep -q '\[X\] PyTorch' <<<"$CHECK" || die "Horovod was built without PyTorch support:
$CHECK"
grep -q '\[X\] Gloo' <<<"$CHECK" || die "Horovod was built without Gloo support:
$CHECK"
log "horovodrun --check-build: PyTorch and Gloo available"

echo "$STAMP_WANT" >"$STAMP_FILE"
log "set-up finished in $(( $(date +%s) - start )) s"
