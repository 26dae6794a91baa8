#!/usr/bin/env bash
# Install the OpenMMLab stack and mmslab into a virtualenv inside the repository (.venv).
#
#   bash tools/install_deps.sh
#
# mmcv 2.1.0 has no wheel for Python 3.11 + torch 2.14, so it is built once from its PyPI
# source with the compiled CPU ops (about 15 minutes on 2 cores; tools/mmcv_recipe.sh) into a
# cache outside the repository ($MMSLAB_WHEELS, default ~/.cache/mmslab/wheels) and reused.
# With everything in place a re-run takes a few seconds.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MMSLAB_VENV:-$REPO/.venv}"
WHEELS="${MMSLAB_WHEELS:-$HOME/.cache/mmslab/wheels}"
PY="${PYTHON:-python3}"
STEP="start"

log() { echo "[install_deps $(date +%H:%M:%S)] $*"; }
step() { STEP="$*"; log "$STEP"; }
trap 'echo "[install_deps] FAILED during step: $STEP (see the output above)" >&2' ERR

VPY="$VENV/bin/python"
# Fast path: everything importable and the pinned versions present.
if [ -x "$VPY" ] && "$VPY" - <<'PYEOF' 2>/dev/null
import importlib.metadata as md
pins = {'torch': '2.14.1', 'torchvision': '0.29.1', 'mmcv': '2.1.0', 'mmengine': '0.10.7',
        'mmdet': '3.3.0', 'mmsegmentation': '1.2.2'}
for name, version in pins.items():
    assert md.version(name).split('+')[0] == version, name
for name in ('timm', 'pycocotools', 'ftfy', 'regex', 'matplotlib', 'pytest', 'onnx',
             'onnxruntime', 'openvino', 'nncf', 'mmslab'):
    md.version(name)
import mmcv.ops, mmdet, mmseg, onnxruntime, openvino  # noqa
PYEOF
then
    log "environment in $VENV is complete"
    exit 0
fi

mkdir -p "$WHEELS"
if [ ! -x "$VPY" ]; then
    step "creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
PIP=("$VPY" -m pip install --disable-pip-version-check)

if ! "$VPY" -c "import torch, torchvision" 2>/dev/null; then
    step "installing torch 2.14.1 and torchvision 0.29.1"
    "${PIP[@]}" -q torch==2.14.1 torchvision==0.29.1
fi

if ! "$VPY" -c "import mmcv.ops" 2>/dev/null; then
    MMCV_WHEEL="$(ls "$WHEELS"/mmcv-2.1.0-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$MMCV_WHEEL" ]; then
        step "building mmcv 2.1.0 with compiled CPU ops (about 10-17 minutes)"
        BUILD="$(mktemp -d)"
        "${PIP[@]}" -q ninja wheel opencv-python-headless addict yapf packaging pyyaml
        bash "$REPO/tools/mmcv_recipe.sh" prepare "$VPY" "$BUILD"
        bash "$REPO/tools/mmcv_recipe.sh" build "$VPY" "$BUILD"
        cp "$BUILD"/dist/mmcv-2.1.0-*.whl "$WHEELS"/
        MMCV_WHEEL="$(ls "$WHEELS"/mmcv-2.1.0-*.whl | head -n1)"
        rm -rf "$BUILD"
    fi
    step "installing cached mmcv wheel $MMCV_WHEEL"
    "${PIP[@]}" -q "$MMCV_WHEEL"
fi

step "installing mmengine, mmdet, mmseg and the rest"
"${PIP[@]}" -q mmengine==0.10.7 mmdet==3.3.0 mmsegmentation==1.2.2 timm ftfy regex \
    pycocotools matplotlib pytest

step "installing the deployment runtimes (onnx, onnxruntime, openvino, nncf)"
"${PIP[@]}" -q "onnx>=1.17" "onnxruntime>=1.20" "openvino>=2025.0" "nncf>=2.16"

step "installing mmslab (editable) and checking the pins of setup.cfg"
"${PIP[@]}" -q -e "$REPO"

step "checking dependency consistency (pip check)"
"$VPY" -m pip check

step "checking the compiled ops"
"$VPY" - <<'PYEOF'
import torch
from mmcv.ops import nms, roi_align
boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.], [20., 20., 30., 30.]])
_, keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
assert keep.tolist() == [0, 2], keep
feat = torch.arange(16.).view(1, 1, 4, 4)
out = roi_align(feat, torch.tensor([[0., 0., 0., 4., 4.]]), (2, 2), 1.0, 2, 'avg', True)
assert out.shape == (1, 1, 2, 2)
import mmdet, mmseg, mmslab
print(f'stack ok: torch {torch.__version__}, mmdet {mmdet.__version__}, '
      f'mmseg {mmseg.__version__}, mmslab {mmslab.__version__}')
PYEOF
log "done: activate with 'source $VENV/bin/activate'"
