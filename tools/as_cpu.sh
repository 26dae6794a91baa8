#!/usr/bin/env bash
# Run a command as on an x86 CPU without AVX-512, VNNI, bf16 or AMX, to check what the
# runtimes compute there (never to time it: every instruction is emulated):
#   sudo bash tools/as_cpu.sh [--cpu MODEL] COMMAND [ARGS...]
# e.g. sudo bash tools/as_cpu.sh .venv/bin/python -m pytest tests/test_deploy.py -k int8
#
# QEMU's user-mode emulator runs COMMAND with the CPUID of MODEL (default EPYC-Rome, an AMD
# EPYC with AVX2 only; QEMU emulates up to AVX2 whatever the model), so PyTorch,
# onnxruntime and OpenVINO pick that CPU's kernels. /proc/cpuinfo, where mmslab reads the
# same facts, is replaced in a private mount namespace by the host's without the AVX-512,
# AVX-VNNI and AMX flags. Needs root (the mount) and qemu-user (Debian / Ubuntu:
# apt-get install qemu-user); `qemu-x86_64 -cpu help` lists the models.
set -euo pipefail
MODEL=EPYC-Rome
if [ "${1:-}" = "--cpu" ]; then
    MODEL="$2"
    shift 2
fi
if [ $# -eq 0 ]; then
    echo "usage: sudo bash tools/as_cpu.sh [--cpu MODEL] COMMAND [ARGS...]" >&2
    exit 2
fi
if ! command -v qemu-x86_64 >/dev/null; then
    echo "as_cpu.sh: qemu-x86_64 not found; install qemu-user" >&2
    exit 2
fi
CPUINFO="$(mktemp)"
trap 'rm -f "$CPUINFO"' EXIT
sed -E 's/ (avx512[a-z_0-9]*|avx_vnni|amx[a-z_0-9]*)//g' /proc/cpuinfo > "$CPUINFO"
# (QEMU warns once per CPUID feature the model names but it does not emulate: noise here)
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec qemu-x86_64 -cpu "$1" "${@:2}"' \
    "$CPUINFO" "$MODEL" "$@" 2> >(grep -v "TCG doesn't support requested feature" >&2)
