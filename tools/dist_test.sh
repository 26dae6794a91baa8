#!/usr/bin/env bash
# Multi-process testing: tools/dist_test.sh CONFIG CHECKPOINT NPROC [tools/test.py args...]
# (environment variables: see tools/torchrun.sh)
set -euo pipefail
if [ "$#" -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT NPROC [test.py args...]" >&2
    exit 2
fi
CONFIG=$1
CHECKPOINT=$2
NPROC=$3
shift 3
exec bash "$(dirname "${BASH_SOURCE[0]}")/torchrun.sh" "$NPROC" test.py "$CONFIG" "$CHECKPOINT" "$@"
