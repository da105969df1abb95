#!/usr/bin/env bash
# Create ./.venv (if missing) and install everything the CPU path needs.
#
# torch: where no NVIDIA GPU is visible, the CPU build from PyTorch's CPU wheel index
# (TORCH_INDEX, default https://download.pytorch.org/whl/cpu; its 2.13.0+cpu outranks PyPI's
# 2.13.0): a plain `pip install torch` on Linux pulls the CUDA build and gigabytes of nvidia-*
# wheels a CPU never uses. With a GPU, or TORCH_INDEX=pypi, PyPI's default build.
# An index that does not answer within 10 s (an air-gapped machine, a registry proxy that only
# serves PyPI) is named and skipped, so pip does not retry it for every package; pip then takes
# torch==2.13.0 from what its own configuration reaches. TORCH_INDEX_CHECK=0 skips that check.
# --dry-run prints the choice and the pip commands without running them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && DRY_RUN=1

if [ -z "${TORCH_INDEX:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        TORCH_INDEX=pypi
    else
        TORCH_INDEX=https://download.pytorch.org/whl/cpu
    fi
fi
if [ "$TORCH_INDEX" = pypi ]; then
    echo "setup_env: torch==$TORCH_VERSION from PyPI (its default build: CUDA on Linux)"
    torch_source=()
elif [ "${TORCH_INDEX_CHECK:-1}" != 0 ] && ! "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$TORCH_INDEX" >/dev/null 2>&1; then
    echo "setup_env: $TORCH_INDEX does not answer: torch==$TORCH_VERSION from pip's own configuration instead (PyPI's build is CUDA on Linux unless pip finds a local CPU wheel; set TORCH_INDEX to a reachable CPU index)"
    torch_source=()
else
    echo "setup_env: torch==$TORCH_VERSION, CPU build, from $TORCH_INDEX (no GPU found or TORCH_INDEX set; TORCH_INDEX=pypi for PyPI's CUDA build)"
    torch_source=(--extra-index-url "$TORCH_INDEX")
fi

run() {
    if [ "$DRY_RUN" = 1 ]; then echo "+ $*"; else "$@"; fi
}
if [ ! -x .venv/bin/python ]; then
    run "$PYTHON" -m venv .venv
fi
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ "$DRY_RUN" = 0 ] && .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    echo "setup_env: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') already in .venv"
else
    run "${pip[@]}" "torch==$TORCH_VERSION" ${torch_source[@]+"${torch_source[@]}"}
fi
run "${pip[@]}" -e '.[dev,test]'
