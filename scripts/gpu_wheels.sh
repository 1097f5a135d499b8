#!/usr/bin/env bash
# Wheels of the lab's runtime packages, for a GPU machine that has CUDA torch but no package
# index (a CUDA image with no network): scripts/gpu_check.sh installs from them when
# scripts/setup.sh cannot reach an index. Run it where pip works; the folder is ignored by git.
#
#   bash scripts/gpu_wheels.sh              # for the GPU machine's Python 3.12, into build/gpu-wheels
#   bash scripts/gpu_wheels.sh 3.11 DIR     # another Python version or folder
#
# ipyparallel at the version installed here (the one the tests ran with), with everything it
# needs; pip on the GPU machine takes only what its own site-packages lack (~16 MB in all).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
version=${1:-3.12}
dir=${2:-build/gpu-wheels}
ipp=$("$py" -c "import ipyparallel; print('ipyparallel==' + ipyparallel.__version__)" 2>/dev/null || echo "ipyparallel>=8.8")
"$py" -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$ipp" cloudpickle
echo "gpu_wheels: $(ls "$dir" | wc -l) wheels ($(du -sh "$dir" | cut -f1)) in $dir for Python $version, $ipp"
