#!/usr/bin/env bash
# The GPU acceptance check: the first thing to run on a machine with NVIDIA GPUs.
#
#   bash tools/gpu_check.sh [--iters 200] [--real-iters 10] [--repeat 20]
#       [--out work_dirs/gpu_check]
#
# Installs with mmcv's CUDA ops (tools/install_deps.sh; MMSLAB_PYTHON=... uses an existing
# environment and its torch), checks mmcv's CUDA ops against their CPU results, trains the
# demo SLAB-Swin-T Mask R-CNN with AMP on CUDA (2 processes when 2+ GPUs), evaluates the fused
# model through ReparamEvalHook, trains the real 1x / 160k configs (Mask R-CNN, RetinaNet,
# UperNet) a few iterations each with --amp at their own input size and validates them, and
# times fused / unfused / mmdet's Swin-T / mmslab's LayerNorm control at 800x1333 in fp32 and
# fp16. Prints one table; writes gpu_check.json.
# Refuses on a machine without a GPU.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "error: no NVIDIA GPU found (nvidia-smi is missing or lists none): tools/gpu_check.sh" \
         "is the GPU acceptance check. On a CPU machine run 'bash tools/demo.sh' instead." >&2
    exit 2
fi
bash "$REPO/tools/install_deps.sh"
PY="${MMSLAB_PYTHON:-$REPO/.venv/bin/python}"
cd "$REPO"
exec "$PY" tools/gpu_check.py "$@"
