#!/usr/bin/env bash
# Shared by dist_train.sh / dist_test.sh: torchrun NPROC processes of a tools/*.py script.
#   tools/torchrun.sh NPROC SCRIPT [script args...]
# Environment: PYTHON (interpreter), PORT (default 29500), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1). Without CUDA the tools run the processes over gloo on the CPU.
set -euo pipefail
NPROC=$1
SCRIPT=$2
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
    "$REPO/tools/$SCRIPT" "$@" --launcher pytorch
