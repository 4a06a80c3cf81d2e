#!/usr/bin/env bash
# One set-up path for `make demo` and `make test`, on Python 3.10, 3.11 or 3.12.
#
# 1. picks the interpreter: $PYTHON (a name on PATH, a pyenv version name such
#    as python3.12, or a path), else python3.11, else python3; and the venv:
#    $PKSAMPLER_VENV, else .venv/ for 3.11 (the default) and .venv-3.X/ for
#    another version. A venv made by another interpreter is rebuilt;
# 2. installs torch==2.13.0 first (on 3.11 the CPU wheel on this host; an
#    unpinned torch would pull the multi-GB CUDA build), then this project in
#    editable mode with its dev extras under a constraints file that pins the
#    installed torch, so no extra (pytorch-metric-learning, tensorboard, ...)
#    can replace it; the parity tests' reference code (timm and torchvision's
#    Python files) goes to $VENV/reference/, outside site-packages: the
#    torchvision wheel cannot load against the CPU torch, and once installed
#    it breaks `import lightning` (torchmetrics imports it when present);
# 3. builds Horovod 0.28.1 from its PyPI sdist with PyTorch + Gloo (no MPI,
#    TensorFlow or MXNet), patched for torch >= 2.1 (C++17) and Python 3.12
#    (no distutils), plus NCCL for GPU tensors when a CUDA torch, nvcc and a
#    GPU are present; caches the wheel outside the clone, keyed by Horovod,
#    torch, Python tag, machine and gloo/nccl, so the next set-up takes seconds;
# 4. fails loudly unless `horovodrun --check-build` lists PyTorch and Gloo
#    (and NCCL for a GPU build).
#
# A stamp in the venv records the inputs of a finished set-up; re-running on a
# ready machine only compares the stamp and exits.
#
# `setup.sh --print-venv` prints the venv this set-up would use and exits
# (the Makefile and scripts/test.sh use it, so all three agree).
#
# Environment: PYTHON, PKSAMPLER_VENV, PKSAMPLER_CACHE (wheel cache),
# PKSAMPLER_HOROVOD_GPU=auto|nccl|none (auto: NCCL only with a CUDA torch,
# nvcc on PATH and a visible GPU; `nccl` forces it on a GPU-less build host),
# HOROVOD_NCCL_HOME, HOROVOD_BUILD_CUDA_CC_LIST (passed to the Horovod build).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_PYTHON_VERSION="3.11"
TORCH_VERSION="2.13.0"
# torchvision's release built with that torch: only its Python code is used, by the parity tests
TORCHVISION_VERSION="0.28.0"
HOROVOD_VERSION="0.28.1"
CACHE_DIR="${PKSAMPLER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pksampler}"

log() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# --- interpreter and venv ---------------------------------------------------
runs() { "$1" -c 'import sys' >/dev/null 2>&1; }

# A pyenv shim on PATH answers `command -v python3.12` but refuses to run when
# 3.12 is not the selected pyenv version: fall back to pyenv's own install.
resolve_python() {
    local name="$1" candidate
    if runs "$name"; then
        "$name" -c 'import sys; print(sys.executable)'
        return
    fi
    if [[ "$name" =~ ^python([0-9]+\.[0-9]+)$ ]] && command -v pyenv >/dev/null 2>&1; then
        for candidate in $(ls -d "$(pyenv root)/versions/${BASH_REMATCH[1]}".* 2>/dev/null | sort -V -r); do
            if runs "$candidate/bin/$name"; then
                echo "$candidate/bin/$name"
                return
            fi
        done
    fi
    return 1
}

if [[ -n "${PYTHON:-}" ]]; then
    PYBIN="$(resolve_python "$PYTHON")" \
        || die "PYTHON=$PYTHON: no such interpreter (not runnable on PATH, nor a pyenv version)"
else
    PYBIN="$(resolve_python "python$DEFAULT_PYTHON_VERSION" || resolve_python python3)" \
        || die "neither python$DEFAULT_PYTHON_VERSION nor python3 runs; set PYTHON=..."
fi
PYVER="$("$PYBIN" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$PYBIN" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)' \
    || die "PYTHON=$PYBIN is Python $PYVER; pksampler needs 3.10 or newer (3.10, 3.11 and 3.12 are tested)"
"$PYBIN" -c 'import sys; sys.exit(0 if sys.version_info[:2] <= (3, 12) else 1)' \
    || log "warning: Python $PYVER is untested (3.10, 3.11 and 3.12 are); Horovod $HOROVOD_VERSION may not build"

if [[ -n "${PKSAMPLER_VENV:-}" ]]; then
    VENV="$PKSAMPLER_VENV"
elif [[ "$PYVER" == "$DEFAULT_PYTHON_VERSION" || -z "${PYTHON:-}" ]]; then
    VENV="$ROOT/.venv"
else
    VENV="$ROOT/.venv-$PYVER"
fi

if [[ "${1:-}" == "--print-venv" ]]; then
    echo "$VENV"
    exit 0
fi

# --- CJK fonts (the typeface benchmark and its test) ---------------------------
# Installed only when a font file is missing and this is root with apt-get;
# otherwise nothing runs (the benchmark then prints the command itself).
FONT_PACKAGES=(fonts-noto-cjk fonts-arphic-ukai fonts-arphic-uming fonts-wqy-zenhei fonts-wqy-microhei)
FONT_FILES=(NotoSansCJK-Regular.ttc NotoSansCJK-Bold.ttc NotoSerifCJK-Regular.ttc NotoSerifCJK-Bold.ttc
    ukai.ttc uming.ttc wqy-zenhei.ttc wqy-microhei.ttc)
fonts_missing() {
    local name
    for name in "${FONT_FILES[@]}"; do
        [[ -n "$(find /usr/share/fonts /usr/local/share/fonts -name "$name" -print -quit 2>/dev/null)" ]] || return 0
    done
    return 1
}
if fonts_missing; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing the CJK fonts: ${FONT_PACKAGES[*]}"
        { DEBIAN_FRONTEND=noninteractive apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${FONT_PACKAGES[@]}"; } \
            >/dev/null || log "warning: installing the CJK fonts failed; the typeface benchmark's test will fail"
    else
        log "note: the CJK fonts of the typeface benchmark are missing; as root run:" \
            "apt-get update && apt-get install -y --no-install-recommends ${FONT_PACKAGES[*]}"
    fi
fi

# --- stamp --------------------------------------------------------------------
PYFULL="$("$PYBIN" -c 'import sys; print(sys.version.split()[0])')"
GPU_MODE="${PKSAMPLER_HOROVOD_GPU:-auto}"
[[ "$GPU_MODE" =~ ^(auto|nccl|none)$ ]] || die "PKSAMPLER_HOROVOD_GPU=$GPU_MODE: must be auto, nccl or none"

stamp_inputs() {
    cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh"
    echo "python=$PYBIN $PYFULL torch=$TORCH_VERSION horovod=$HOROVOD_VERSION gpu=$GPU_MODE"
}
STAMP_WANT="$(stamp_inputs | sha256sum | cut -d' ' -f1)"
STAMP_FILE="$VENV/.pksampler-setup-stamp"

if [[ -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP_WANT" && -x "$VENV/bin/horovodrun" ]] \
    && [[ "$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)" == "$PYFULL" ]]; then
    log "environment is up to date ($VENV, Python $PYFULL)"
    exit 0
fi

start=$(date +%s)
if [[ -e "$VENV" ]]; then
    have="$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo none)"
    if [[ "$have" != "$PYFULL" ]]; then
        [[ -f "$VENV/pyvenv.cfg" ]] || die "$VENV exists and is not a virtual environment; move it away"
        log "$VENV was made with Python $have, not $PYFULL ($PYBIN): rebuilding it"
        rm -rf "$VENV"
    fi
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment $VENV with $PYBIN (Python $PYFULL)"
    "$PYBIN" -m venv "$VENV"
fi
[[ -f "$VENV/.gitignore" ]] || echo '*' >"$VENV/.gitignore"   # a venv beside the sources stays out of git status
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check --no-input)
# Installs skip pip's byte-compilation: the environment holds ~14,700 Python files (torch 2,285, the dev extras the
# rest) and a training rank imports ~2,000 modules. What runs is compiled when it is first imported, by set-up's
# own checks and the import of the trainer's libraries at the end, or by the first test process that imports it
# (scripts/test.sh); so set-up's processes write bytecode whatever PYTHONDONTWRITEBYTECODE says (with it set, each
# check below compiled what it imports from source and threw it away: 19 s for `horovodrun --check-build` alone).
INSTALL=("${PIP[@]}" install -q --no-compile)
unset PYTHONDONTWRITEBYTECODE

"${PIP[@]}" install -q --upgrade "pip>=23.2" "setuptools>=77" wheel

# --- torch first, then everything else under a constraint that keeps it ------
log "installing torch==$TORCH_VERSION"
"${INSTALL[@]}" "torch==$TORCH_VERSION" "numpy>=1.24"   # numpy with it: torch warns at import without it
"$PY" -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$TORCH_VERSION' else 'torch %s was installed instead of $TORCH_VERSION' % torch.__version__)"
TORCH_CUDA="$("$PY" -c 'import torch; print(torch.version.cuda or "")')"
log "torch $("$PY" -c 'import torch; print(torch.__version__)') ($([[ -n "$TORCH_CUDA" ]] && echo "CUDA $TORCH_CUDA" || echo CPU) build)"

CONSTRAINTS="$VENV/pksampler-constraints.txt"
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
log "installing pksampler (editable) with dev extras"
"${INSTALL[@]}" -c "$CONSTRAINTS" -e "$ROOT[dev]"
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 'an extra replaced torch with %s' % torch.__version__)"

# --- the parity tests' reference code, where nothing else imports it -----------
# torchvision's PyPI wheel is built against the CUDA torch: its package __init__
# cannot register its compiled operators (torchvision::nms) against the CPU torch,
# and torchmetrics (under Lightning) imports it whenever it is installed. So the
# environment holds no torchvision (an earlier set-up's is removed, with the timm
# that needs it); tests/reference_models.py loads timm's and torchvision's own
# Python code from $VENV/reference/.
for stale in torchvision timm; do
    if "$PY" -m pip show -q "$stale" >/dev/null 2>&1; then
        log "removing $stale from the environment (its reference code goes to $VENV/reference)"
        "${PIP[@]}" uninstall -q -y "$stale"
    fi
done
log "installing the parity tests' reference code (timm, torchvision $TORCHVISION_VERSION) into $VENV/reference"
rm -rf "$VENV/reference"
"${INSTALL[@]}" --no-deps --target "$VENV/reference/timm" "timm>=1.0"
"${INSTALL[@]}" --no-deps --target "$VENV/reference/torchvision" "torchvision==$TORCHVISION_VERSION"
"$PY" -c "import lightning, torch.utils.data" || die "import lightning fails in $VENV (docs/frameworks.md)"

# --- Horovod ------------------------------------------------------------------
# NCCL for GPU tensors needs a CUDA torch and nvcc; `auto` also wants a visible
# GPU, so a host with the CUDA toolkit but no GPU keeps the tested CPU build.
if [[ "$GPU_MODE" == "auto" ]]; then
    GPU_MODE=none
    if [[ -n "$TORCH_CUDA" ]] && command -v nvcc >/dev/null 2>&1 \
        && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        GPU_MODE=nccl
    fi
fi
if [[ "$GPU_MODE" == "nccl" ]]; then
    [[ -n "$TORCH_CUDA" ]] || die "PKSAMPLER_HOROVOD_GPU=nccl needs a CUDA build of torch; torch.version.cuda is None"
    command -v nvcc >/dev/null 2>&1 || die "PKSAMPLER_HOROVOD_GPU=nccl needs nvcc on PATH"
    FLAVOUR="nccl-cu$TORCH_CUDA"
else
    FLAVOUR="gloo"
fi

PYTAG="cp${PYVER/./}"
ARCH="$(uname -m)"
WHEEL_DIR="$CACHE_DIR/wheels/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$PYTAG-$ARCH-$FLAVOUR"
mkdir -p "$WHEEL_DIR"
WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)"

# Replace one exact text in an unpacked source file; fail when it is not there,
# so a changed sdist cannot silently skip a fix.
patch_source() {
    "$PY" - "$@" <<'EOF' || die "patch of $1 failed: the expected line is not there"
import pathlib, sys
path, old, new = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
text = path.read_text()
if old not in text:
    sys.exit(f"{path}: {old!r} not found")
path.write_text(text.replace(old, new))
EOF
}

# The pip package nvidia-nccl-cuXX (installed with a CUDA torch) ships nccl.h
# and libnccl.so.2 but no libnccl.so; give Horovod's FindNCCL a home with both.
nccl_home_from_wheel() {
    local pkg
    pkg="$("$PY" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)" || return 1
    [[ -f "$pkg/include/nccl.h" ]] || return 1
    mkdir -p "$BUILD/nccl/lib"
    ln -s "$pkg/include" "$BUILD/nccl/include"
    ln -s "$pkg"/lib/libnccl.so.* "$BUILD/nccl/lib/"
    ln -s "$(ls "$pkg"/lib/libnccl.so.* | head -n1)" "$BUILD/nccl/lib/libnccl.so"
    echo "$BUILD/nccl"
}

build_horovod() {
    log "building Horovod $HOROVOD_VERSION ($FLAVOUR) from the PyPI sdist (takes a few minutes)"
    if ! command -v cmake >/dev/null 2>&1; then
        log "no cmake on PATH; installing cmake<4 into the venv"
        "${PIP[@]}" install -q "cmake>=3.13,<4"
        export PATH="$VENV/bin:$PATH"
    fi
    BUILD="$(mktemp -d "${TMPDIR:-/tmp}/pksampler-horovod.XXXXXX")"
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
    local src="$BUILD/horovod-$HOROVOD_VERSION"
    # torch >= 2.1 needs C++17.
    patch_source "$src/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    patch_source "$src/horovod/torch/CMakeLists.txt" 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
    # Python 3.12 removed distutils: the build asks it for the include folder,
    # and horovodrun imports find_executable from it at start-up.
    patch_source "$src/horovod/torch/CMakeLists.txt" \
        'from distutils.sysconfig import get_python_inc; print(get_python_inc())' \
        "import sysconfig; print(sysconfig.get_paths()['include'])"
    patch_source "$src/horovod/runner/js_run.py" \
        'from distutils.spawn import find_executable' 'from shutil import which as find_executable'
    "${PIP[@]}" install -q -c "$CONSTRAINTS" psutil cloudpickle pyyaml packaging

    local -a flags=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo
        CMAKE_POLICY_VERSION_MINIMUM=3.5 "MAKEFLAGS=-j$(nproc)")
    if [[ "$FLAVOUR" == nccl-* ]]; then
        # CUDA >= 12 headers need C++17 in nvcc too (Horovod pins its kernels to C++11).
        patch_source "$src/horovod/common/ops/cuda/CMakeLists.txt" \
            'set(CMAKE_CUDA_STANDARD 11)' 'set(CMAKE_CUDA_STANDARD 17)'
        local nccl_home="${HOROVOD_NCCL_HOME:-$(nccl_home_from_wheel || true)}"
        [[ -n "$nccl_home" ]] && flags+=("HOROVOD_NCCL_HOME=$nccl_home" HOROVOD_NCCL_LINK=SHARED)
        # Compile the CUDA kernels only for the architectures torch was built for.
        local cc_list="${HOROVOD_BUILD_CUDA_CC_LIST:-$("$PY" -c \
            'import torch; print(",".join(sorted({a.split("_")[1] for a in torch.cuda.get_arch_list() if a.startswith("sm_")})))')}"
        flags+=(HOROVOD_GPU_OPERATIONS=NCCL "HOROVOD_BUILD_CUDA_CC_LIST=$cc_list")
        log "NCCL build: nccl home ${nccl_home:-<system>}, CUDA architectures $cc_list"
    else
        # With a CUDA torch and nvcc on PATH (PyPI's torch for 3.10/3.12 is the
        # CUDA build) Horovod compiles CUDA into its torch extension on its own,
        # which needs the full toolkit; the CPU build must not.
        patch_source "$src/cmake/Modules/FindPytorch.cmake" \
            'print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)' 'print(False)'
    fi
    (
        cd "$src"
        env "${flags[@]}" "${PIP[@]}" wheel -q --no-build-isolation --no-deps -w "$BUILD/dist" . \
            || die "Horovod build failed (see the compiler output above)"
    )
    cp "$BUILD"/dist/horovod-*.whl "$WHEEL_DIR/.tmp.whl"
    WHEEL="$WHEEL_DIR/$(basename "$BUILD"/dist/horovod-*.whl)"
    mv "$WHEEL_DIR/.tmp.whl" "$WHEEL"   # atomic: a half-copied wheel is never cached
    log "cached $WHEEL"
}

if [[ -z "$WHEEL" ]]; then
    build_horovod
else
    log "using cached Horovod wheel $WHEEL"
fi
"${INSTALL[@]}" -c "$CONSTRAINTS" "$WHEEL"

CHECK="$("$VENV/bin/horovodrun" --check-build 2>&1)" || die "horovodrun --check-build failed: $CHECK"
grep -q '\[X\] PyTorch' <<<"$CHECK" || die "Horovod was built without PyTorch support:
$CHECK"
grep -q '\[X\] Gloo' <<<"$CHECK" || die "Horovod was built without Gloo support:
$CHECK"
if [[ "$FLAVOUR" == nccl-* ]]; then
    grep -q '\[X\] NCCL' <<<"$CHECK" || die "Horovod was built without NCCL support:
$CHECK"
fi
log "horovodrun --check-build: PyTorch and Gloo available$([[ "$FLAVOUR" == gloo ]] || echo ", NCCL for GPU tensors")"

# --- bytecode of what every rank imports -----------------------------------------
# The installs above wrote no bytecode. Importing the trainer's and the launchers' libraries once compiles the
# modules they read, so a rank started with PYTHONDONTWRITEBYTECODE set (as on some machines) does not compile
# them from source at every start. torch._dynamo (with sympy, ~800 modules) is what a torch optimizer imports at
# its construction and first step.
log "compiling the modules the trainer and its launchers import"
"$PY" -c "$(printf 'import %s\n' torch torch._dynamo torch.distributed.run torch.utils.tensorboard \
    numpy PIL.Image faiss yaml tqdm matplotlib.pyplot safetensors.torch obstore horovod.torch horovod.runner.launch)" \
    || die "importing the trainer's libraries fails in $VENV"

echo "$STAMP_WANT" >"$STAMP_FILE"
log "set-up finished in $(( $(date +%s) - start )) s (Python $PYFULL, $VENV)"
