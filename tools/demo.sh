#!/usr/bin/env bash
# The main job: train SLAB-Swin-T Mask R-CNN on the synthetic COCO set, evaluate the fused
# model, report latency fused vs unfused (demo size and full test size, against mmdet's
# LayerNorm Swin-T), deploy the whole model (ONNX / OpenVINO, fp32 / bf16 / INT8 timed; the
# fastest on this machine evaluated) and draw the fused model's predictions.
#   bash tools/demo.sh [extra train.py args]
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/tools/install_deps.sh"
cd "$REPO"
PY="$REPO/.venv/bin/python"
CONFIG="${DEMO_CONFIG:-configs/demo/mask_rcnn_slab_swin_t_demo.py}"
WORK="${DEMO_WORK_DIR:-work_dirs/$(basename "$CONFIG" .py)}"
# The synthetic set goes to a root of its own, the one configs/demo/ read, apart from data/coco
# and data/ade where real datasets live; the tool stops rather than write among files it did
# not write.
"$PY" "$REPO/tools/make_demo_data.py" --out data/mmslab_demo --kind "${DEMO_KIND:-coco}"
START=$(date +%s)
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK" "$@"
CKPT="$(cat "$WORK/last_checkpoint")"
# At the demo's 256x256 the heads dominate; time the trained model also at the real test size
# of the 1x / 160k configs, fused vs unfused vs the same model with mmdet's LayerNorm Swin-T and
# with mmslab's own LayerNorm Swin-T (the control: what the method alone buys).
if [ "${DEMO_KIND:-coco}" = coco ]; then FULL_SHAPE=800x1333; else FULL_SHAPE=512x512; fi
"$PY" tools/benchmark.py "$CONFIG" --checkpoint "$CKPT" --shapes "$FULL_SHAPE" \
    --parts backbone model --baseline-backbone swin_t ln_swin_t --repeat 5 --warmup 1 \
    --out "$WORK/full_size_speed"
# The deployed form: the whole fused model exported (free input size), INT8 for both
# runtimes, every form timed at the full test size next to eager PyTorch; the export records
# which form runs fastest on this machine (export.json: latency.deploy), and that one is
# evaluated.
"$PY" tools/export_onnx.py "$CONFIG" "$CKPT" --out "$WORK/export" --int8 --calib-images 16 \
    --latency "$FULL_SHAPE" --repeat 3
read -r BACKEND PRECISION < <("$PY" -c 'import json, sys
d = json.load(open(sys.argv[1]))["latency"]["deploy"]
print(d["runtime"], d["precision"])' "$WORK/export/export.json")
"$PY" tools/test.py "$CONFIG" "$CKPT" --backend "$BACKEND" --precision "$PRECISION" \
    --export-dir "$WORK/export" --work-dir "$WORK/deployed_${BACKEND}_${PRECISION}"
"$PY" tools/visualize_predictions.py "$CONFIG" "$CKPT" --num-images 4 --out "$WORK/predictions"
"$PY" tools/summarize_run.py "$WORK" --elapsed $(( $(date +%s) - START ))
