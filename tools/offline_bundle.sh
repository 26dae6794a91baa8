#!/usr/bin/env bash
# Prepare, on a machine with internet access, what an offline GPU machine (a cluster node, a
# container without a package index) needs to install mmslab into its own Python and torch:
# the mmcv 2.1.0 wheel with CUDA ops built for that Python, torch and GPU arch, and the wheels
# of the packages such an environment usually lacks. No GPU is needed here: only a Python of
# the target's minor version and nvcc of torch's CUDA major (tools/install_deps.sh checks).
#
#   bash tools/offline_bundle.sh --python 3.12 --torch 2.11.0 --arch 9.0 [--out bundle]
#        [--cache DIR] [--with-openvino]
#
#   --python   the target's Python minor version (a python3.12 on PATH, or pyenv's)
#   --torch    the target's torch version; the build installs torch==VERSION from the
#              package index pip uses (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL pick other builds)
#   --arch     TORCH_CUDA_ARCH_LIST for the target's GPUs (9.0: H100 / H200, 8.0: A100)
#   --out      the bundle directory (default: bundle): cache/ (the mmcv wheel, in the layout
#              MMSLAB_WHEELS reads), wheels/ (for PIP_FIND_LINKS), INSTALL.txt
#   --cache    an mmcv wheel cache to reuse (MMSLAB_WHEELS layout); default OUT/cache
#   --with-openvino  also openvino and nncf with their requirements (deployment; about
#              120 MB more)
#
# Copy the bundle and the repository to the GPU machine and run there what INSTALL.txt says.
# Building the wheel takes about 25 minutes per arch on 2 cores (once per cache).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "error: $*" >&2; exit 2; }
log() { echo "[offline_bundle $(date +%H:%M:%S)] $*"; }

PY_VERSION="" TORCH_VERSION="" ARCH="" OUT="bundle" CACHE="" OPENVINO=0
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY_VERSION="${2:-}"; shift 2 ;;
        --torch) TORCH_VERSION="${2:-}"; shift 2 ;;
        --arch) ARCH="${2:-}"; shift 2 ;;
        --out) OUT="${2:-}"; shift 2 ;;
        --cache) CACHE="${2:-}"; shift 2 ;;
        --with-openvino) OPENVINO=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1'; valid: --python, --torch, --arch, --out, --cache," \
               "--with-openvino (see --help)" ;;
    esac
done
[[ "$PY_VERSION" =~ ^3\.[0-9]+$ ]] || \
    die "--python '$PY_VERSION': give the target's Python minor version, e.g. --python 3.12"
[[ "$TORCH_VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || \
    die "--torch '$TORCH_VERSION': give the target's torch version, e.g. --torch 2.11.0"
[[ "$ARCH" =~ ^[0-9]+\.[0-9]+a?(\+PTX)?([\;\ ][0-9]+\.[0-9]+a?(\+PTX)?)*$ ]] || \
    die "--arch '$ARCH': give TORCH_CUDA_ARCH_LIST for the target's GPUs, e.g. --arch 9.0" \
        "(H100 / H200) or --arch '8.0;9.0'"
[ -n "$OUT" ] || die "--out is empty"

# the interpreter: python3.X on PATH, else pyenv's newest 3.X
PY=""
if command -v "python$PY_VERSION" >/dev/null 2>&1 && \
        "python$PY_VERSION" -c 'import venv' >/dev/null 2>&1; then
    PY="$(command -v "python$PY_VERSION")"
else
    for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$PY_VERSION".* 2>/dev/null |
                       sort -V -r); do
        if [ -x "$candidate/bin/python$PY_VERSION" ]; then
            PY="$candidate/bin/python$PY_VERSION"
            break
        fi
    done
fi
[ -n "$PY" ] || die "no Python $PY_VERSION found (python$PY_VERSION on PATH, or pyenv's" \
                    "versions/$PY_VERSION.*): install it, it builds the wheel the target loads"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
CACHE="${CACHE:-$OUT/cache}"
mkdir -p "$CACHE" "$OUT/wheels"
CACHE="$(cd "$CACHE" && pwd)"
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT

log "build environment: $PY ($("$PY" --version 2>&1)), torch==$TORCH_VERSION"
"$PY" -m venv "$BUILD/venv"
BPY="$BUILD/venv/bin/python"
"$BPY" -m pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
CUDA="$("$BPY" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null)"
[ -n "$CUDA" ] || die "torch==$TORCH_VERSION from this package index is a CPU-only build;" \
                      "point PIP_INDEX_URL at PyTorch's index for the target's CUDA"
log "torch $("$BPY" -c 'import torch; print(torch.__version__)' 2>/dev/null) (CUDA $CUDA)"

# the mmcv wheel, built (or found in the cache) exactly as the target's installer looks for it
MMSLAB_PYTHON="$BPY" MMSLAB_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MMSLAB_OPENVINO=0 \
    MMSLAB_WHEELS="$CACHE" bash "$REPO/tools/install_deps.sh"
KEY="$(cat "$BUILD/venv/mmslab-mmcv-build.txt")"
WHEEL="$(ls "$CACHE/mmcv-2.1.0/$KEY/"mmcv-2.1.0-*.whl)"
if [ "$CACHE" != "$OUT/cache" ]; then
    mkdir -p "$OUT/cache/mmcv-2.1.0/$KEY"
    cp "$WHEEL" "$OUT/cache/mmcv-2.1.0/$KEY/"
fi

# what the target's Python may lack (torch, numpy, OpenCV, timm, onnx and onnxruntime are
# taken from the environment as they are; install_deps.sh reports any still missing)
log "downloading wheels for Python $PY_VERSION"
# (ruff: the linter tools/install_deps.sh installs, at its pinned version)
RUFF_VERSION="$(sed -n 's/^RUFF_VERSION=//p' "$REPO/tools/install_deps.sh")"
PACKAGES=(mmengine==0.10.7 mmdet==3.3.0 mmsegmentation==1.2.2 pycocotools ftfy wcwidth regex
          addict yapf platformdirs termcolor terminaltables shapely prettytable rich
          markdown-it-py mdurl pygments "ruff==$RUFF_VERSION")
download() {
    "$BPY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
        --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$OUT/wheels" "$@"
}
download --no-deps "${PACKAGES[@]}"
if [ "$OPENVINO" = 1 ]; then
    # (their requirements, numpy and scipy among them, with them: pip installs only what the
    # target lacks)
    download 'openvino>=2025.0' 'nncf>=2.16'
fi

cat > "$OUT/INSTALL.txt" <<EOF
On the GPU machine (Python $PY_VERSION, torch $TORCH_VERSION with CUDA $CUDA, GPUs of arch $ARCH),
in the mmslab repository, with this bundle at BUNDLE:

  PIP_NO_INDEX=1 PIP_FIND_LINKS=BUNDLE/wheels MMSLAB_WHEELS=BUNDLE/cache \\
  MMSLAB_OPENVINO=$OPENVINO TORCH_CUDA_ARCH_LIST='$ARCH' MMSLAB_PYTHON=\$(command -v python3) \\
  bash tools/install_deps.sh          # or tools/gpu_check.sh, which installs first

TORCH_CUDA_ARCH_LIST must be set as above: a container's own value (9.0a, say) asks for
another wheel than the one in the bundle (cache key $KEY).
EOF
log "done: $OUT ($(du -sh "$OUT" | cut -f1)): mmcv wheel $(basename "$WHEEL")," \
    "$(ls "$OUT/wheels" | wc -l) wheels"
cat "$OUT/INSTALL.txt"
