#!/usr/bin/env bash
# keras-lms demo (`make demo`): 3D U-Net lesion segmentation with LMS on 2 Horovod ranks (Gloo, CPU),
# embedded synthetic data, then the run's summary. Artefacts: runs/demo/ (see docs/examples.md).
#
#   bash scripts/demo.sh [PYTHON]        PYTHON defaults to .venv/bin/python
#
# Environment overrides: DEMO_OUT (runs/demo), DEMO_NP (2), DEMO_ARGS (extra flags for the example).
set -euo pipefail

PY="${1:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
  echo "demo: no Python at $PY (run 'make install' first)" >&2
  exit 2
fi
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"   # absolute (keeps the venv's symlink), then go to the repo
cd "$(dirname "$0")/.."
BIN="$(dirname "$PY")"
HOROVODRUN="$BIN/horovodrun"
OUT="${DEMO_OUT:-runs/demo}"
NP="${DEMO_NP:-2}"
if [ ! -x "$HOROVODRUN" ]; then
  echo "demo: $HOROVODRUN not found: Horovod is not installed in this environment (make install)" >&2
  exit 2
fi

# One compute thread per rank (2 ranks on a 2-core machine): no oversubscription by OpenMP/oneDNN or TF pools.
export OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1
# The demo is a CPU demo (reproducible on any machine): GPUs are hidden.
export TF_CPP_MIN_LOG_LEVEL=2 KERAS_BACKEND=tensorflow CUDA_VISIBLE_DEVICES=""
# CPU allocator statistics for peak_device_mib (TensorFlow keeps them only on NUMA machines by default).
export TF_CPU_ALLOCATOR_USE_BFC=true
export PYTHONUNBUFFERED=1
# horovodrun starts the ranks through PATH lookups of `python`: use the venv's.
export PATH="$BIN:$PATH"

rm -rf "$OUT"
mkdir -p "$OUT"
echo "demo: 3D segmentation, LMS, $NP Horovod ranks (Gloo) on CPU -> $OUT"
start=$(date +%s)
# shellcheck disable=SC2086
"$HOROVODRUN" -np "$NP" -H "localhost:$NP" --gloo \
  "$PY" examples/segmentation_3d.py --horovod --lms \
    --volume 48 --depth 3 --base-filters 8 --batch-size 2 \
    --epochs 20 --steps-per-epoch 20 --val-steps 4 --lr 1e-3 --warmup-epochs 1 \
    --workers 1 --verbose 2 --seed 0 --out "$OUT" ${DEMO_ARGS:-}
end=$(date +%s)

echo
echo "demo: finished in $((end - start)) s; summary ($OUT/summary.json):"
"$PY" examples/summary.py "$OUT"   # the example's own summary printer (examples/artefacts.py: print_summary)
