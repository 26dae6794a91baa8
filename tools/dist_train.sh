#!/usr/bin/env bash
# Multi-process training: tools/dist_train.sh CONFIG NPROC [tools/train.py args...]
# Environment: PYTHON (interpreter), PORT (default 29500), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1).
# Without CUDA, tools/train.py runs the processes over gloo on the CPU.
set -euo pipefail
if [ "$#" -lt 2 ]; then
    echo "usage: $0 CONFIG NPROC [train.py args...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# interpreter: $PYTHON if set, else the repository's venv, else python on PATH
PY="${PYTHON:-$REPO/.venv/bin/python}"
[ -n "${PYTHON:-}" ] || [ -x "$PY" ] || PY=python

PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
exec "$PY" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --nproc_per_node="$NPROC" \
    --master_port="${PORT:-29500}" \
    "$REPO/tools/train.py" "$CONFIG" --launcher pytorch "$@"
