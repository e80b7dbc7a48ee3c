#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (TensorFlow + Gloo [+ MPI]) into the Python environment given as $1.
#
#   bash scripts/install_horovod.sh .venv/bin/python
#
# Idempotent: if `horovod.tensorflow` already imports (and is built with MPI when OpenMPI is present) it
# exits at once. The wheel it builds is cached in ~/.cache/keras-lms/wheels, so recreating the venv reinstalls
# in seconds instead of rebuilding (3-8 min on 2 cores).
#
# Why a source build: there is no Horovod wheel on PyPI, and the 0.28.1 sdist does not compile against
# TensorFlow >= 2.19 as shipped. The one source change we make (see docs/horovod.md) is to drop
# horovod/tensorflow/xla_mpi_ops.cc from horovod/tensorflow/CMakeLists.txt: that file implements the optional
# XLA custom-call path (HOROVOD_ENABLE_XLA_OPS), includes XLA headers TensorFlow moved, and needs
# highwayhash/farmhash include paths the TF wheel does not ship. Nothing else in keras_lms needs it.
#
# Environment knobs (all optional):
#   HOROVOD_VERSION        default 0.28.1 (the source fix is only verified for 0.28.1)
#   KERAS_LMS_WHEEL_CACHE  default ~/.cache/keras-lms/wheels ($XDG_CACHE_HOME/keras-lms/wheels)
#   KERAS_LMS_SKIP_MPI=1   never apt-get OpenMPI; build with Gloo only
#   MAKEFLAGS              default -j<number of CPUs>
#   HOROVOD_GPU_OPERATIONS passed through to Horovod's build if set (e.g. NCCL); unset = CPU/Gloo/MPI ops only
set -euo pipefail

HVD_VERSION="${HOROVOD_VERSION:-0.28.1}"
# Per user, not per checkout: a fresh clone on the same machine (CI clones main for every run) reuses the build.
CACHE="${KERAS_LMS_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/keras-lms/wheels}"

say()  { printf '[install_horovod] %s\n' "$*"; }
die()  { printf '[install_horovod] ERROR: %s\n' "$*" >&2; exit 1; }

[ $# -ge 1 ] || die "usage: bash scripts/install_horovod.sh PATH/TO/python (e.g. .venv/bin/python)"
PY="$1"
[ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || die "python '$PY' not found"
PY="$(command -v "$PY")"
PY_BIN_DIR="$(cd "$(dirname "$PY")" && pwd)"
PY="$PY_BIN_DIR/$(basename "$PY")"  # absolute, but not symlink-resolved (a venv's python is a symlink)
# Keep the venv's bin first so setup.py finds *this* python, pip and (if installed there) cmake.
export PATH="$PY_BIN_DIR:$PATH"
# Keep TensorFlow's C++ start-up chatter (oneDNN, cpu_feature_guard) out of this script's output.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"


# --------------------------------------------------------------------------------------------- OpenMPI
have_mpi() { command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; }
if ! have_mpi && [ "${KERAS_LMS_SKIP_MPI:-0}" != "1" ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        say "OpenMPI not found: apt-get install openmpi-bin libopenmpi-dev"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null || die "apt-get update failed"
        apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null \
            || die "apt-get install openmpi-bin libopenmpi-dev failed"
    else
        say "WARNING: OpenMPI (mpirun/mpicxx) not found and not root with apt-get: building with Gloo only."
        say "         Install openmpi-bin and libopenmpi-dev and rerun this script to add the MPI controller."
    fi
fi
WANT_MPI=0
if have_mpi && [ "${KERAS_LMS_SKIP_MPI:-0}" != "1" ]; then WANT_MPI=1; fi

# ---------------------------------------------------------------------------------- already installed?
# Exit 0 when horovod.tensorflow imports and its build has what we want (TF ops, Gloo, and MPI if present).
horovod_ok() {
    "$PY" - "$WANT_MPI" <<'EOF' 2>/dev/null
import sys
import horovod.tensorflow as hvd
want_mpi = sys.argv[1] == "1"
ok = hvd.gloo_built() and (hvd.mpi_built() or not want_mpi)
sys.exit(0 if ok else 1)
EOF
}

check_build() {
    local hr="$PY_BIN_DIR/horovodrun"
    [ -x "$hr" ] || die "horovodrun not found next to $PY"
    say "horovodrun --check-build:"
    local out
    out="$("$hr" --check-build 2>&1)" || { echo "$out"; die "horovodrun --check-build failed"; }
    # Drop TensorFlow's start-up log lines; keep Horovod's table. ("[X] PyTorch" is a known false positive
    # of --check-build: it only finds the horovod.torch Python package, which has no native library here.)
    out="$(grep -v -e '^I0000' -e '^WARNING: All log messages' -e '^To enable the following' -e '^W0000' <<<"$out")"
    echo "$out"
    grep -q '\[X\] TensorFlow' <<<"$out" || die "Horovod was built without TensorFlow support"
    grep -q '\[X\] Gloo' <<<"$out" || die "Horovod was built without Gloo"
    if [ "$WANT_MPI" = "1" ]; then grep -q '\[X\] MPI' <<<"$out" || die "Horovod was built without MPI"; fi
}

if horovod_ok; then
    say "horovod.tensorflow already importable with $PY ($("$PY" -c 'import horovod; print(horovod.__version__)')) - nothing to do"
    exit 0
fi

# -------------------------------------------------------------------------------------- cached wheel
"$PY" -c "import tensorflow" 2>/dev/null \
    || die "TensorFlow is not importable with $PY; install the package first (make install does that)"
mkdir -p "$CACHE"
install_wheel() {
    # With dependencies: Horovod needs cloudpickle, psutil, pyyaml and packaging at runtime (all pure Python).
    # First replace any installed horovod (same version, maybe built against another TF) without touching
    # other packages, then let pip add the missing dependencies.
    "$PY" -m pip install -q --force-reinstall --no-deps "$1" 2>&1 | grep -v "is ignored: it is neither" || true
    "$PY" -m pip install -q "$1" 2>&1 | grep -v "is ignored: it is neither" || true
    "$PY" -m pip show -q horovod >/dev/null 2>&1 || die "pip install $1 failed"
}

shopt -s nullglob
cached=("$CACHE"/horovod-"$HVD_VERSION"-*.whl)
shopt -u nullglob
if [ ${#cached[@]} -gt 0 ]; then
    say "installing cached wheel ${cached[0]}"
    install_wheel "${cached[0]}"
    if horovod_ok; then
        check_build
        say "done (from cache)"
        exit 0
    fi
    say "cached wheel does not work with this environment (different TensorFlow or no MPI); rebuilding"
    "$PY" -m pip uninstall -y -q horovod || true
    rm -f "${cached[@]}"
fi

# ------------------------------------------------------------------------------------- source build
command -v cmake >/dev/null 2>&1 || die "cmake not found (apt-get install cmake, or pip install cmake into the venv)"
command -v g++ >/dev/null 2>&1 || die "g++ not found (apt-get install g++)"
CMAKE_MAJOR="$(cmake --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')"
if [ "${CMAKE_MAJOR:-0}" -ge 4 ]; then
    # Bundled gloo declares cmake_minimum_required(VERSION 2.8.12), which CMake 4 rejects.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    say "CMake >= 4 detected: CMAKE_POLICY_VERSION_MINIMUM=3.5"
fi
# setup.py imports setuptools and packaging; --no-build-isolation means they must be in the target env.
"$PY" -c "import setuptools, packaging, wheel" 2>/dev/null \
    || { say "installing build requirements (setuptools, packaging, wheel)"; "$PY" -m pip install -q setuptools packaging wheel; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say "downloading horovod==$HVD_VERSION sdist from PyPI"
"$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$WORK" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
SDIST="$(ls "$WORK"/horovod-"$HVD_VERSION".tar.gz 2>/dev/null || true)"
[ -n "$SDIST" ] || die "could not download the horovod==$HVD_VERSION sdist (is PyPI reachable?)"
tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/horovod-$HVD_VERSION"

# Source fix: do not compile the XLA custom-call ops (see header comment and docs/horovod.md).
TF_CMAKE="$SRC/horovod/tensorflow/CMakeLists.txt"
if grep -q 'xla_mpi_ops.cc' "$TF_CMAKE"; then
    sed -i '/xla_mpi_ops\.cc/d' "$TF_CMAKE"
    say "patched $(basename "$(dirname "$(dirname "$TF_CMAKE")")")/tensorflow/CMakeLists.txt: removed xla_mpi_ops.cc"
fi
grep -q 'xla_mpi_ops.cc' "$TF_CMAKE" && die "failed to patch $TF_CMAKE"

export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1
unset HOROVOD_WITHOUT_GLOO HOROVOD_WITHOUT_TENSORFLOW 2>/dev/null || true
# HOROVOD_GPU_OPERATIONS (e.g. NCCL on GPU hosts with the NCCL headers) is passed through if you set it.
if [ "$WANT_MPI" = "1" ]; then
    export HOROVOD_WITH_MPI=1; unset HOROVOD_WITHOUT_MPI 2>/dev/null || true
else
    export HOROVOD_WITHOUT_MPI=1; unset HOROVOD_WITH_MPI 2>/dev/null || true
fi
export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"

# The build log lives beside the wheel it produces, in the directory this script has just created (a log under
# the checkout once failed on every fresh clone because nothing created its directory: issue 25).
LOG="$CACHE/horovod-$HVD_VERSION-build.log"
: >"$LOG" 2>/dev/null || die "cannot write the build log $LOG (set KERAS_LMS_WHEEL_CACHE to a writable directory)"
say "building horovod $HVD_VERSION wheel: TensorFlow $("$PY" -c 'import tensorflow as tf; print(tf.__version__)'), Gloo, MPI=$WANT_MPI, MAKEFLAGS=$MAKEFLAGS"
say "this takes 3-8 min on 2 cores (150-210 s measured on the 2-core dev VM); full log: $LOG"
start=$(date +%s)
"$PY" -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir -w "$CACHE" "$SRC" >"$LOG" 2>&1 &
pid=$!
# Heartbeat so CI logs show progress (and do not time out on silence).
while kill -0 "$pid" 2>/dev/null; do
    sleep 30
    kill -0 "$pid" 2>/dev/null || break
    pct="$(grep -o '\[ *[0-9]*%\]' "$LOG" 2>/dev/null | tail -n1 | tr -d '[] ' || true)"
    say "  ... building ($(( $(date +%s) - start ))s elapsed${pct:+, cmake progress $pct})"
done
if ! wait "$pid"; then
    echo "----- last 60 lines of $LOG -----" >&2
    tail -n 60 "$LOG" >&2
    die "horovod build failed after $(( $(date +%s) - start ))s; see $LOG"
fi
say "build finished in $(( $(date +%s) - start ))s"

shopt -s nullglob
built=("$CACHE"/horovod-"$HVD_VERSION"-*.whl)
shopt -u nullglob
[ ${#built[@]} -gt 0 ] || die "pip wheel succeeded but no wheel in $CACHE"
say "installing ${built[0]}"
install_wheel "${built[0]}"
horovod_ok || die "horovod installed but 'import horovod.tensorflow' fails (or lacks Gloo/MPI): $("$PY" -c 'import horovod.tensorflow' 2>&1 | tail -n 3)"
check_build
say "done"
