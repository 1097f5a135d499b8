#!/usr/bin/env bash
# Build a wheelhouse for a workshop: one folder with every wheel labkit and the lab need, so
# that 20 laptops on one Wi-Fi install from a USB stick or a file share instead of each
# downloading torch. The trainer runs this once, on a machine with a network:
#
#   make wheelhouse                                   # wheelhouse/ for this machine (OS, CPU, Python)
#   PLATFORMS="manylinux_2_28_x86_64 macosx_11_0_arm64" PYVER=3.12 bash scripts/wheelhouse.sh
#                                                     # ... for other laptops' OS/CPU (binary wheels only)
#
# Each laptop then installs with no network at all (docs/workshop.md):
#
#   python3 -m venv .venv
#   .venv/bin/python -m pip install --no-index --find-links wheelhouse "labkit[lab]"
#
# torch comes from PyTorch's CPU index (PyPI's Linux wheel is the CUDA build, gigabytes more
# than a laptop needs); everything else from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${WHEELHOUSE:-wheelhouse}
TORCH_VERSION=${LABKIT_TORCH_VERSION:-2.13.0}
INDEX=(--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple)
mkdir -p "$OUT"

echo "labkit: building labkit's own wheel into $OUT/"
"$PY" -m pip wheel --no-deps --wheel-dir "$OUT" .
labkit_wheel=$(ls -t "$OUT"/labkit-*.whl | head -n 1)

if [ -z "${PLATFORMS:-}" ]; then
  echo "labkit: downloading torch $TORCH_VERSION (CPU) and the lab's packages for this machine"
  "$PY" -m pip download --dest "$OUT" "${INDEX[@]}" "torch==$TORCH_VERSION" "${labkit_wheel}[lab]"
else
  PYVER=${PYVER:?set PYVER (e.g. 3.12) with PLATFORMS}
  for platform in $PLATFORMS; do
    echo "labkit: downloading wheels for $platform, Python $PYVER"
    "$PY" -m pip download --dest "$OUT" "${INDEX[@]}" --only-binary=:all: --platform "$platform" \
        --python-version "$PYVER" --implementation cp "torch==$TORCH_VERSION" "${labkit_wheel}[lab]"
  done
fi
echo "labkit: $(ls "$OUT" | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in $OUT/"
echo "labkit: on each laptop: python3 -m venv .venv && .venv/bin/python -m pip install --no-index --find-links $OUT \"labkit[lab]\""
