#!/usr/bin/env bash
# mini_ddp GPU check: parity with NCCL and Gloo-on-CUDA, torch.cuda.comm, CUDA streams.
# Usage: scripts/gpu_check.sh [--cpu-dry-run] [--only abcd]
# Uses mini_ddp from this checkout (PYTHONPATH=src) and $PYTHON (default python3).
# Writes the PASS/FAIL table to $OUT/gpu_check.txt when OUT is set.
# Exit status: 0 all passed, 1 a check failed, 2 no torch / no CUDA.
set -u
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: '$PYTHON' cannot import torch; install torch first (or set PYTHON=...)."
    exit 2
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" scripts/gpu_check.py "$@"
