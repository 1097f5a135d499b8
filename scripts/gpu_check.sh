#!/usr/bin/env bash
# The GPU check: set up the way the README does, then prove (or disprove) labkit's GPU paths in
# one bounded run (scripts/gpu_check.py lists the parts and the files it writes).
#
#   bash scripts/gpu_check.sh [--out DIR]                      # DIR: $OUT if set, else out/gpu
#   LABKIT_PYTHON=.venv/bin/python bash scripts/gpu_check.sh   # skip the set-up, use this interpreter
#
# Set-up is `bash scripts/setup.sh` (CUDA torch where nvidia-smi lists a GPU). Where the system
# python3 already has CUDA torch (a CUDA image), .venv is first made with --system-site-packages,
# so setup.sh keeps that torch rather than installing another. With no package index in reach,
# pip runs offline (setup.sh then fails fast on the notebook packages) and the lab's runtime
# packages come from build/gpu-wheels (`bash scripts/gpu_wheels.sh` fetches them where pip works);
# the report says so. LABKIT_GPU_BUDGET (default 300 s) bounds the checks after set-up.
# Exit status: the check's (1 if any part failed, each named on the last line), 2 if set-up failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
[ "${1:-}" = "--out" ] && out=${2:?--out needs a folder}
budget=${LABKIT_GPU_BUDGET:-300}
wheels=build/gpu-wheels
mkdir -p "$out"
say() { echo "gpu_check: $*"; }

setup() {
  if [ ! -x .venv/bin/python ] && python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    say "python3 has CUDA torch $(python3 -c 'import torch; print(torch.__version__)'): .venv sees its packages"
    # (--without-pip where the interpreter has no ensurepip: python3's own pip then serves .venv)
    python3 -m venv --system-site-packages .venv 2>/dev/null \
      || python3 -m venv --system-site-packages --without-pip .venv || return 1
    # python3 may itself be a venv (the CUDA image's is), whose packages --system-site-packages
    # does not reach: a .pth file puts its site-packages on .venv's path, after .venv's own.
    local site
    site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" > "$site/_labkit_host_python.pth"
    .venv/bin/python -c "import torch" || { say ".venv cannot import python3's torch"; return 1; }
  fi
  if ! timeout 5 python3 -c "import socket; socket.create_connection(('pypi.org', 443), timeout=3)" 2>/dev/null; then
    say "no package index in reach: pip runs offline"
    export PIP_NO_INDEX=1
  fi
  [ -d "$wheels" ] && export PIP_FIND_LINKS="$PWD/$wheels${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"
  if timeout 900 bash scripts/setup.sh > "$out/setup.log" 2>&1; then
    say "scripts/setup.sh: ready"
    return 0
  fi
  say "scripts/setup.sh failed; its last line: $(tail -n 1 "$out/setup.log")"
  if [ ! -d "$wheels" ]; then
    say "and there is no $wheels to fall back on: run 'bash scripts/gpu_wheels.sh' where pip works"
    return 1
  fi
  say "fallback: the lab's runtime packages from $wheels; labkit from this checkout (PYTHONPATH)"
  .venv/bin/python -m pip install -q --no-index --find-links "$wheels" ipyparallel cloudpickle >> "$out/setup.log" 2>&1
}

if [ -n "${LABKIT_PYTHON:-}" ]; then
  py=$LABKIT_PYTHON
  say "set-up skipped: using $py"
else
  t0=$SECONDS
  setup || { say "set-up failed (see $out/setup.log)"; exit 2; }
  say "set-up took $((SECONDS - t0)) s"
  py=.venv/bin/python
fi
# The check bounds each part itself; this outer limit catches anything that escapes it.
PYTHONUNBUFFERED=1 timeout -k 10 $((budget + 60)) "$py" scripts/gpu_check.py --out "$out" --budget "$budget"
rc=$?
[ $rc -eq 124 ] && say "the check ran past $((budget + 60)) s and was stopped"
exit $rc
