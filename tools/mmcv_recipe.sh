#!/usr/bin/env bash
# The recipe that builds mmcv 2.1.0 (with its compiled CPU ops) for torch 2.14 / Python 3.11.
#
#   bash tools/mmcv_recipe.sh prepare VENV_PYTHON DIR   # fetch + patch the sdist into DIR
#   bash tools/mmcv_recipe.sh build   VENV_PYTHON DIR   # compile the wheel into DIR/dist
#   bash tools/mmcv_recipe.sh check   VENV_PYTHON [DIR] # prepare + metadata step, no compile
#   bash tools/mmcv_recipe.sh probe   VENV_PYTHON [DIR] # build with only info.cpp + nms_cuda.cu
#
# tools/install_deps.sh runs prepare + build once per machine (the wheel is cached);
# the test suite runs `check` in the real virtualenv, so a recipe that would break on a
# machine without the cache fails CI even when the cache makes the install skip the build.
#
# Why each part is needed:
# * mmcv's setup.py imports pkg_resources. torch 2.14.1 requires setuptools>=77.0.3 and
#   setuptools >= 81 ships no pkg_resources, so the virtualenv's own setuptools cannot run
#   it. An old setuptools (+ wheel) is installed into a private directory that is put first
#   on PYTHONPATH for the mmcv steps only; the virtualenv keeps a setuptools that satisfies
#   torch, so `pip check` passes.
# * --no-build-isolation: an isolated build has no torch and silently skips the ops.
# * torch >= 2.13 headers need C++20; mmcv 2.1.0 hard-codes -std=c++17.
# * CUDA ops: `build` takes the environment tools/install_deps.sh gets from
#   mmslab/utils/cuda_build.py (FORCE_CUDA, CUDA_HOME, TORCH_CUDA_ARCH_LIST, and the include
#   directories of torch's CUDA wheels in NVCC_APPEND_FLAGS / CPATH); without it, CPU ops.
set -euo pipefail

MODE="${1:?usage: mmcv_recipe.sh prepare|build|check|probe VENV_PYTHON [DIR]}"
VPY="${2:?the virtualenv python}"
DIR="${3:-$(mktemp -d)}"
SRC="$DIR/mmcv-2.1.0"
TOOLS="$DIR/buildtools"
log() { echo "[mmcv_recipe $(date +%H:%M:%S)] $*"; }

buildtools() {
    if [ ! -d "$TOOLS/pkg_resources" ]; then
        log "private build tools (setuptools<70 with pkg_resources, wheel) in $TOOLS"
        "$VPY" -m pip install -q --disable-pip-version-check --no-deps --target "$TOOLS" \
            "setuptools>=61,<70" "wheel<0.46"
    fi
}

prepare() {
    buildtools
    mkdir -p "$DIR"
    if [ ! -d "$SRC" ]; then
        log "downloading the mmcv 2.1.0 source distribution"
        # pip runs the sdist's metadata step here: it needs the private setuptools too.
        PYTHONPATH="$TOOLS" "$VPY" -m pip download -q --disable-pip-version-check --no-deps \
            --no-binary :all: --no-build-isolation -d "$DIR" mmcv==2.1.0
        tar -xzf "$DIR"/mmcv-2.1.0.tar.gz -C "$DIR"
    fi
    sed -i 's/-std=c++17/-std=c++20/g' "$SRC/setup.py"
    if grep -q -- '-std=c++17' "$SRC/setup.py" || ! grep -q -- '-std=c++20' "$SRC/setup.py"; then
        log "patching the C++ standard in $SRC/setup.py failed"
        exit 1
    fi
}

build() {
    buildtools
    JOBS="${MAX_JOBS:-$(nproc)}"
    log "compiling mmcv (MMCV_WITH_OPS=1, MAX_JOBS=$JOBS, FORCE_CUDA=${FORCE_CUDA:-0}," \
        "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-unset}, CUDA_HOME=${CUDA_HOME:-unset})"
    (cd "$SRC" && PYTHONPATH="$TOOLS" MMCV_WITH_OPS=1 MAX_JOBS="$JOBS" \
        "$VPY" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
        -w "$DIR/dist" .)
    ls "$DIR"/dist/mmcv-2.1.0-*.whl >/dev/null
}

case "$MODE" in
prepare)
    prepare
    ;;
build)
    [ -d "$SRC" ] || prepare
    build
    ;;
probe)
    # The same build (setup.py, flags, environment) over two sources only: the host-compiled
    # info.cpp (includes the CUDA runtime headers when FORCE_CUDA=1) and one .cu file. Minutes
    # instead of the full build's 15-25; the tests use it to check the CUDA recipe.
    prepare
    find "$SRC/mmcv/ops/csrc" \( -name '*.cpp' -o -name '*.cu' \) \
        ! -path '*/csrc/pytorch/info.cpp' ! -path '*/csrc/pytorch/cuda/nms_cuda.cu' -delete
    build
    ;;
check)
    prepare
    log "running the metadata step with the ops enabled (no compilation)"
    (cd "$SRC" && PYTHONPATH="$TOOLS" MMCV_WITH_OPS=1 "$VPY" setup.py -q egg_info \
        --egg-base "$DIR" > "$DIR/egg_info.log" 2>&1) || { cat "$DIR/egg_info.log"; exit 1; }
    # With torch importable the ops are configured; 'Skip building ext ops' means they would
    # be silently missing from the wheel.
    if grep -q "Skip building ext ops" "$DIR/egg_info.log"; then
        cat "$DIR/egg_info.log"
        log "the recipe would build mmcv WITHOUT its compiled ops"
        exit 1
    fi
    grep -q "^Version: 2.1.0" "$DIR"/mmcv.egg-info/PKG-INFO
    log "recipe ok"
    ;;
*)
    echo "unknown mode '$MODE' (valid: prepare, build, check, probe)" >&2
    exit 2
    ;;
esac
