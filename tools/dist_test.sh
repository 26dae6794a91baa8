#!/usr/bin/env bash
# Multi-process testing: tools/dist_test.sh CONFIG CHECKPOINT NPROC [tools/test.py args...]
# Environment: PYTHON (interpreter), PORT (default 29500), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1).
# Without CUDA, tools/test.py runs the processes over gloo on the CPU.
set -euo pipefail
if [ "$#" -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT NPROC [test.py args...]" >&2
    exit 2
fi
CONFIG=$1
CHECKPOINT=$2
NPROC=$3
shift 3
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
    "$REPO/tools/test.py" "$CONFIG" "$CHECKPOINT" --launcher pytorch "$@"
