#!/usr/bin/env bash
# Install the OpenMMLab stack mmslab runs on, into a virtualenv outside the repository.
#
#   bash tools/install_deps.sh          # creates/updates $MMSLAB_VENV (default ~/.cache/mmslab/venv)
#
# mmcv 2.1.0 has no wheel for Python 3.11 + torch 2.14, so it is built once from its PyPI
# source (about 17 minutes on 2 cores) into $MMSLAB_WHEELS and reused afterwards.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MMSLAB_VENV:-$REPO/.venv}"
WHEELS="${MMSLAB_WHEELS:-$HOME/.cache/mmslab/wheels}"

PY="${PYTHON:-python3}"

log() { echo "[install_deps $(date +%H:%M:%S)] $*"; }

mkdir -p "$WHEELS"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check)

# setuptools<70: mmcv's setup.py imports pkg_resources.
"${PIP[@]}" -q "setuptools<70" wheel
if ! "$VPY" -c "import torch, torchvision" 2>/dev/null; then
    log "installing torch"
    "${PIP[@]}" -q torch==2.14.1 torchvision==0.29.1
fi

if ! "$VPY" -c "import mmcv.ops" 2>/dev/null; then
    MMCV_WHEEL="$(ls "$WHEELS"/mmcv-2.1.0-*.whl 2>/dev/null | head -n1 || true)"
    if [ -z "$MMCV_WHEEL" ]; then
        log "building mmcv 2.1.0 with compiled ops (about 17 minutes)"
        BUILD="$(mktemp -d)"
        "$VPY" -m pip download --no-deps --no-binary :all: --no-build-isolation -d "$BUILD" mmcv==2.1.0
        tar -xzf "$BUILD"/mmcv-2.1.0.tar.gz -C "$BUILD"
        # torch >= 2.13 headers need C++20; mmcv 2.1.0 hard-codes c++17.
        sed -i 's/-std=c++17/-std=c++20/g' "$BUILD"/mmcv-2.1.0/setup.py
        "${PIP[@]}" -q ninja "opencv-python-headless" addict yapf packaging pyyaml
        (cd "$BUILD"/mmcv-2.1.0 && MMCV_WITH_OPS=1 MAX_JOBS="${MAX_JOBS:-2}" \
            "$VPY" -m pip wheel --no-build-isolation --no-deps -w "$WHEELS" .)
        MMCV_WHEEL="$(ls "$WHEELS"/mmcv-2.1.0-*.whl | head -n1)"
        rm -rf "$BUILD"
    fi
    log "installing $MMCV_WHEEL"
    "${PIP[@]}" -q "$MMCV_WHEEL"
fi

log "installing mmengine, mmdet, mmseg and mmslab"
"${PIP[@]}" -q mmengine==0.10.7 mmdet==3.3.0 mmsegmentation==1.2.2 timm ftfy regex pycocotools \
    matplotlib pytest
"${PIP[@]}" -q --no-deps -e "$REPO"
"$VPY" -c "import mmcv.ops, mmdet, mmseg, mmslab; print('stack ok: mmcv', mmcv.__version__, 'mmdet', mmdet.__version__, 'mmseg', mmseg.__version__)"
