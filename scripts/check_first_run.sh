#!/usr/bin/env bash
# The pip user's first run, outside the repository (issue 25): build keras-lms' wheel, install it with the
# TensorFlow CPU extra into a new venv, then run `keras-lms info` and examples/quickstart.py from another directory,
# so that keras_lms is imported from the installed wheel (its package data included), not from the checkout.
#
#   bash scripts/check_first_run.sh [PYTHON]     PYTHON builds the venv; default python3
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE_PY="${1:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/keras-lms-first-run.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say() { printf '[first-run] %s\n' "$*"; }

start=$(date +%s)
"$BASE_PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --upgrade pip build
say "python -m build --wheel"
"$VPY" -m build -q --wheel --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
    || { tail -n 40 "$WORK/build.log" >&2; say "ERROR: building the wheel failed"; exit 1; }
WHEEL="$(ls "$WORK"/dist/keras_lms-*.whl)"
say "pip install $(basename "$WHEEL")[tensorflow-cpu] into a new venv"
"$VPY" -m pip install -q "$WHEEL[tensorflow-cpu]"

cd "$WORK"   # not the checkout: keras_lms must come from the wheel
export TF_CPP_MIN_LOG_LEVEL=2
location="$("$VPY" -c 'import keras_lms, os; print(os.path.dirname(keras_lms.__file__))')"
case "$location" in
    "$WORK/venv/"*) say "keras_lms imports from the wheel: $location" ;;
    *) say "ERROR: keras_lms imported from $location, not from the installed wheel"; exit 1 ;;
esac
say "keras-lms info"
"$WORK/venv/bin/keras-lms" info
say "examples/quickstart.py"
"$VPY" "$REPO/examples/quickstart.py" --epochs 1
say "passed in $(( $(date +%s) - start )) s"
