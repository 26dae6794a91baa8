#!/usr/bin/env bash
# Install whatever is missing, lint (ruff, pyproject.toml), then run the test suite:
#   bash tools/run_tests.sh [--fast] [pytest args]
# --fast skips the tests marked slow (builds, multi-process training, end-to-end tool runs,
# torch.compile, the longer exports); README.md says how long each lane takes.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/install_deps.sh"
cd "$REPO"
# Lint before the tests: seconds, and a failure stops the run before minutes of tests.
TIMEFORMAT='[run_tests] ruff check: %R s'
time "$REPO/.venv/bin/python" -m ruff check .
ARGS=()
if [ "${1:-}" = "--fast" ]; then
    shift
    ARGS=(-m "not slow")
fi
# pytest exits 5 when it collects nothing; that is a failure here, like any non-zero code.
exec "$REPO/.venv/bin/python" -m pytest -q "${ARGS[@]}" "$@"
