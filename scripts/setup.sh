#!/usr/bin/env bash
# Create .venv (if missing) and install labkit with everything the lab and its tests need.
#
#   bash scripts/setup.sh          # what `make setup` / `make lab` / `make test` run
#
# torch is chosen for the machine: where `nvidia-smi` lists a GPU, PyPI's Linux wheel (the
# CUDA build); elsewhere the CPU build, from a local wheel if pip can find one (find-links),
# otherwise from PyTorch's CPU index. Override with LABKIT_TORCH_SPEC / LABKIT_TORCH_INDEX.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${LABKIT_TORCH_VERSION:-2.13.0}
stamp="$VENV/.labkit-installed"

if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || { echo "labkit: creating $VENV"; "$PYTHON" -m venv "$VENV"; }
pip() { "$VENV/bin/python" -m pip "$@"; }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${LABKIT_TORCH_SPEC:-}" ]; then
    echo "labkit: installing ${LABKIT_TORCH_SPEC}"
    pip install ${LABKIT_TORCH_INDEX:+--index-url "$LABKIT_TORCH_INDEX"} "$LABKIT_TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "labkit: GPU found, installing CUDA torch==$TORCH_VERSION"
    pip install "torch==$TORCH_VERSION"
  elif pip install --no-index "torch==$TORCH_VERSION+cpu" 2>/dev/null \
       || pip install "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
    echo "labkit: installed CPU torch==$TORCH_VERSION (local wheel)"
    pip install "torch==$TORCH_VERSION+cpu"   # resolve torch's own dependencies
  else
    echo "labkit: installing CPU torch==$TORCH_VERSION from PyTorch's CPU index"
    pip install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
        --extra-index-url https://pypi.org/simple
  fi
fi

echo "labkit: installing labkit and the lab's packages"
pip install -e ".[lab,test,hf]"
touch "$stamp"
echo "labkit: ready ($VENV)"
