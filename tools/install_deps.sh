#!/usr/bin/env bash
# Install the OpenMMLab stack and mmslab: into a virtualenv inside the repository (.venv), or
# into an existing Python environment that already has torch.
#
#   bash tools/install_deps.sh                               # .venv with torch 2.14.1
#   MMSLAB_PYTHON=/usr/bin/python3 bash tools/install_deps.sh  # that environment, its own torch
#
# Variables (all optional):
#   MMSLAB_VENV     the virtualenv to create or complete (default: REPO/.venv)
#   MMSLAB_PYTHON   install into this interpreter's environment instead: no virtualenv, torch
#                   is not (re)installed, mmcv is built against the torch found there
#   MMSLAB_WHEELS   the mmcv wheel cache (default: ~/.cache/mmslab/wheels)
#   MMSLAB_CUDA     auto (default): mmcv's CUDA ops when nvidia-smi lists a GPU, CPU ops
#                   otherwise; 1: CUDA ops even without a GPU; 0: CPU ops only
#   TORCH_CUDA_ARCH_LIST  the GPUs to compile for (default: those present, else 8.0;9.0+PTX)
#   MAX_JOBS        parallel compile jobs (default: the number of cores)
#   MMSLAB_OPENVINO 1 (default): also OpenVINO and NNCF (the extra 'openvino', about 100 MB,
#                   for deployment); 0: without them (training, PyTorch and onnxruntime only)
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR   (pip's own) install offline from wheels carried in
#
# mmcv 2.1.0 has no wheel for Python 3.11 + torch 2.14, so it is built once from its PyPI
# source (tools/mmcv_recipe.sh; CPU ops about 15 minutes on 2 cores, CUDA ops for one arch
# about 25) into a cache keyed by Python, torch, CUDA and arch list
# (mmslab/utils/cuda_build.py decides), and reused. With everything in place a re-run takes
# a few seconds.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${MMSLAB_WHEELS:-$HOME/.cache/mmslab/wheels}"
PY="${PYTHON:-python3}"
OPENVINO="${MMSLAB_OPENVINO:-1}"
# The linter tools/run_tests.sh runs before the tests; .pre-commit-config.yaml pins the same.
RUFF_VERSION=0.17.6
case "$OPENVINO" in
    0|1) ;;
    *) echo "error: MMSLAB_OPENVINO=$OPENVINO; valid: 1 (install OpenVINO and NNCF), 0 (without)" >&2
       exit 2 ;;
esac
STEP="start"

log() { echo "[install_deps $(date +%H:%M:%S)] $*"; }
step() { STEP="$*"; log "$STEP"; }
trap 'echo "[install_deps] FAILED during step: $STEP (see the output above)" >&2' ERR

if [ -n "${MMSLAB_PYTHON:-}" ]; then
    # An existing environment (a cluster module, a container): use its torch as it is.
    VPY="$MMSLAB_PYTHON"
    EXISTING=1
    if ! "$VPY" -c "import torch" 2>/dev/null; then
        echo "error: MMSLAB_PYTHON=$VPY cannot import torch; install torch there first, or" \
             "leave MMSLAB_PYTHON unset to create a virtualenv with torch 2.14.1" >&2
        exit 1
    fi
else
    VENV="${MMSLAB_VENV:-$REPO/.venv}"
    VPY="$VENV/bin/python"
    EXISTING=0
    if [ ! -x "$VPY" ]; then
        step "creating virtualenv $VENV"
        "$PY" -m venv "$VENV"
    fi
    if ! "$VPY" -c "import torch, torchvision" 2>/dev/null; then
        step "installing torch 2.14.1 and torchvision 0.29.1"
        "$VPY" -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
    fi
fi
PIP=("$VPY" -m pip install --disable-pip-version-check)
if [ "$EXISTING" = 1 ]; then
    # The environment's torch (and torchvision) stay as they are: without this, a package that
    # needs torchvision (timm) would pull the newest one and upgrade torch with it.
    PINS="$(mktemp)"
    "$VPY" - > "$PINS" <<'PYEOF'
import importlib.metadata as md
for name in ('torch', 'torchvision'):
    try:
        print(f'{name}=={md.version(name)}')
    except md.PackageNotFoundError:
        pass
PYEOF
    log "keeping this environment's $(tr '\n' ' ' < "$PINS")"
    PIP+=(-c "$PINS")
fi
# Where the installed mmcv records which build it is (compared with the plan's cache key).
MARKER="$("$VPY" -c 'import sys; print(sys.prefix)')/mmslab-mmcv-build.txt"

# Which mmcv this machine needs: CPU or CUDA ops, for which torch / CUDA / GPUs. Refuses a
# CUDA build that could not work, naming the fix, before anything is compiled.
PLAN="$("$VPY" -P "$REPO/mmslab/utils/cuda_build.py" plan)" || {
    echo "[install_deps] the mmcv build plan was refused (above); nothing was compiled" >&2
    exit 1; }
eval "$PLAN"

# Fast path: everything importable, the pinned versions present, the mmcv build the plan asks.
if [ "$(cat "$MARKER" 2>/dev/null || true)" = "$MMSLAB_MMCV_KEY" ] && \
        MMSLAB_EXISTING=$EXISTING MMSLAB_OPENVINO=$OPENVINO MMSLAB_RUFF=$RUFF_VERSION \
        "$VPY" -P - <<'PYEOF' 2>/dev/null
import importlib
import importlib.metadata as md
import os
pins = {'mmcv': '2.1.0', 'mmengine': '0.10.7', 'mmdet': '3.3.0', 'mmsegmentation': '1.2.2',
        'ruff': os.environ['MMSLAB_RUFF']}
if os.environ['MMSLAB_EXISTING'] == '0':
    pins.update(torch='2.14.1', torchvision='0.29.1')
for name, version in pins.items():
    assert md.version(name).split('+')[0] == version, name
names = ['timm', 'pycocotools', 'ftfy', 'regex', 'matplotlib', 'pytest', 'onnx',
         'onnxruntime', 'mmslab']
if os.environ['MMSLAB_OPENVINO'] == '1':
    names += ['openvino', 'nncf']
for name in names:
    md.version(name)
for module in ('mmcv.ops', 'mmdet', 'mmseg', 'onnxruntime') + (
        ('openvino',) if os.environ['MMSLAB_OPENVINO'] == '1' else ()):
    importlib.import_module(module)
PYEOF
then
    log "environment of $VPY is complete (mmcv build $MMSLAB_MMCV_KEY)"
    exit 0
fi

mkdir -p "$WHEELS"
if [ "$(cat "$MARKER" 2>/dev/null || true)" != "$MMSLAB_MMCV_KEY" ] || \
        ! "$VPY" -c "import mmcv.ops" 2>/dev/null; then
    CACHE="$WHEELS/mmcv-2.1.0/$MMSLAB_MMCV_KEY"
    MMCV_WHEEL="$(ls "$CACHE"/mmcv-2.1.0-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$MMCV_WHEEL" ]; then
        BUILD_ENV=()
        for var in $MMSLAB_BUILD_VARS; do
            value="MMSLAB_BUILD_$var"
            BUILD_ENV+=("$var=${!value}")
        done
        if [ "$MMSLAB_MMCV_KIND" = cuda ]; then
            step "building mmcv 2.1.0 with CUDA ops for $MMSLAB_MMCV_ARCHS (about 25 minutes per arch on 2 cores)"
        else
            step "building mmcv 2.1.0 with compiled CPU ops (about 10-17 minutes on 2 cores)"
        fi
        BUILD="$(mktemp -d)"
        "${PIP[@]}" -q ninja wheel opencv-python-headless addict yapf packaging pyyaml
        bash "$REPO/tools/mmcv_recipe.sh" prepare "$VPY" "$BUILD"
        START=$SECONDS
        env "${BUILD_ENV[@]}" bash "$REPO/tools/mmcv_recipe.sh" build "$VPY" "$BUILD"
        log "mmcv compiled in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s"
        mkdir -p "$CACHE"
        cp "$BUILD"/dist/mmcv-2.1.0-*.whl "$CACHE"/
        MMCV_WHEEL="$(ls "$CACHE"/mmcv-2.1.0-*.whl | head -n1)"
        rm -rf "$BUILD"
    fi
    step "installing cached mmcv wheel $MMCV_WHEEL"
    "${PIP[@]}" -q --force-reinstall --no-deps "$MMCV_WHEEL"
    echo "$MMSLAB_MMCV_KEY" > "$MARKER"
fi

step "installing mmengine, mmdet, mmseg and the rest"
MMENGINE=(mmengine==0.10.7)
MMSLAB_NODEPS=()
if [ "$EXISTING" = 1 ] && "$VPY" -c "import cv2" 2>/dev/null && \
        ! "$VPY" -m pip show -q opencv-python >/dev/null 2>&1; then
    # mmengine asks for opencv-python; an environment with another OpenCV package (a container's
    # opencv-python-headless) keeps it: two OpenCV packages overwrite each other's cv2.
    log "keeping this environment's OpenCV ($("$VPY" -c 'import cv2; print(cv2.__version__)')):" \
        "mmengine is installed without its opencv-python requirement"
    "${PIP[@]}" -q --no-deps mmengine==0.10.7
    # its other requirements, read from its metadata (markers kept for pip to evaluate)
    mapfile -t MMENGINE_REQS < <("$VPY" -P - <<'PYEOF'
import importlib.metadata as md
import re
for req in md.requires('mmengine') or []:
    if 'extra ==' not in req and not re.match(r'opencv-python\b', req):
        print(req)
PYEOF
)
    "${PIP[@]}" -q "${MMENGINE_REQS[@]}"
    MMENGINE=()
    # mmslab's own install would resolve mmengine's requirements again: its requirements are
    # installed here and checked by name after it
    MMSLAB_NODEPS=(--no-deps)
fi
"${PIP[@]}" -q "${MMENGINE[@]}" mmdet==3.3.0 mmsegmentation==1.2.2 timm ftfy regex \
    pycocotools matplotlib pytest "ruff==$RUFF_VERSION"

if [ "$OPENVINO" = 1 ]; then
    step "installing the deployment runtimes (onnx, onnxruntime, openvino, nncf)"
    "${PIP[@]}" -q "onnx>=1.17" "onnxruntime>=1.20" "openvino>=2025.0" "nncf>=2.16"
    TARGET="$REPO[openvino]"
else
    step "installing the deployment runtime onnxruntime (MMSLAB_OPENVINO=0: no OpenVINO, NNCF)"
    "${PIP[@]}" -q "onnx>=1.17" "onnxruntime>=1.20"
    TARGET="$REPO"
fi

step "installing mmslab (editable) and checking the requirements of setup.cfg"
if [ "$EXISTING" = 1 ]; then
    # the environment's own setuptools builds it (an offline container has no other)
    "${PIP[@]}" -q --no-build-isolation "${MMSLAB_NODEPS[@]}" -e "$TARGET"
    "$VPY" -P - <<'PYEOF'
import importlib.metadata as md
import re
missing = []
for req in md.requires('mmslab') or []:
    if 'extra ==' in req:
        continue
    name = re.match(r'[A-Za-z0-9_.-]+', req).group(0)
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(req)
if missing:
    raise SystemExit(f'error: mmslab requirements not installed: {", ".join(missing)}')
PYEOF
else
    "${PIP[@]}" -q -e "$TARGET"
fi

step "checking dependency consistency (pip check)"
if [ "$EXISTING" = 1 ]; then
    "$VPY" -m pip check || log "warning: pip check reports conflicts in this environment" \
        "(above); mmslab's own requirements are installed"
else
    "$VPY" -m pip check
fi

step "checking the compiled ops ($MMSLAB_MMCV_KIND build $MMSLAB_MMCV_KEY)"
# Without a GPU a CUDA build's device code is listed with cuobjdump; one fetched from PyPI
# (0.3 MB) is kept beside the wheel cache.
MMSLAB_CUDA_TOOLS="$WHEELS/cuda-tools" \
"$VPY" -P "$REPO/mmslab/utils/cuda_build.py" verify "$MMSLAB_MMCV_KIND" "$MMSLAB_MMCV_ARCHS"
"$VPY" -P - <<'PYEOF'
import torch
from mmcv.ops import nms, roi_align
boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 10., 10.], [20., 20., 30., 30.]])
_, keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
assert keep.tolist() == [0, 2], keep
feat = torch.arange(16.).view(1, 1, 4, 4)
out = roi_align(feat, torch.tensor([[0., 0., 0., 4., 4.]]), (2, 2), 1.0, 2, 'avg', True)
assert out.shape == (1, 1, 2, 2)
import mmdet, mmseg, mmslab
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'
print(f'stack ok: torch {torch.__version__} ({gpu}), mmdet {mmdet.__version__}, '
      f'mmseg {mmseg.__version__}, mmslab {mmslab.__version__}')
PYEOF
if [ "$EXISTING" = 1 ]; then
    log "done: mmslab is installed in the environment of $VPY"
else
    log "done: activate with 'source $VENV/bin/activate'"
fi
