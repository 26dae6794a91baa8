#!/usr/bin/env bash
# Multi-process training: tools/dist_train.sh CONFIG NPROC [tools/train.py args...]
# (environment variables: see tools/torchrun.sh)
set -euo pipefail
if [ "$#" -lt 2 ]; then
    echo "usage: $0 CONFIG NPROC [train.py args...]" >&2
    exit 2
fi
CONFIG=$1
NPROC=$2
shift 2
exec bash "$(dirname "${BASH_SOURCE[0]}")/torchrun.sh" "$NPROC" train.py "$CONFIG" "$@"
