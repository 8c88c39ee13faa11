#!/usr/bin/env bash
# mini_ddp GPU check: what one GPU can prove (NCCL semantics, streams, Gloo on CUDA), row by row.
# Usage: bash scripts/gpu_check.sh [--cpu-dry-run] [--only TEXT] [--budget-s 240]
# Runs this checkout's mini_ddp (PYTHONPATH=src) with ${PYTHON:-python3}: no virtualenv needed.
# Rows are appended to $OUT/gpu_check.txt (./gpu_check.txt when OUT is unset) as they finish.
# Exit status: 0 no FAIL row, 1 a FAIL row, 2 no torch / no CUDA.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: '$PYTHON' cannot import torch; install torch first (or set PYTHON=...)."
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -u scripts/gpu_check.py "$@"
