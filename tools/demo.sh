#!/usr/bin/env bash
# The main job: fine-tune SLAB-Swin-T Mask R-CNN on the synthetic COCO set, evaluate the fused
# model and report latency fused vs unfused.   bash tools/demo.sh [extra train.py args]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/install_deps.sh"
cd "$REPO"
PY="$REPO/.venv/bin/python"
CONFIG="${DEMO_CONFIG:-configs/demo/mask_rcnn_slab_swin_t_demo.py}"
WORK="${DEMO_WORK_DIR:-work_dirs/$(basename "$CONFIG" .py)}"
"$PY" tools/make_demo_data.py --kind "${DEMO_KIND:-coco}"
START=$(date +%s)
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK" "$@"
"$PY" tools/summarize_run.py "$WORK" --elapsed $(( $(date +%s) - START ))
