#!/usr/bin/env bash
# Creates the CPU test environment for sglang-sparse (no GPU needed), following
# ../shared/ENVIRONMENT.md: torch 2.13.0 CPU build (constraint on every install),
# sglang 0.5.17 with --no-deps plus its light dependencies, the project in editable
# mode, and the test-only CPU runtime (tests/cpu_runtime: platform plugin + torchvision shim).
#
# Usage: bash scripts/setup_cpu_env.sh [VENV_DIR]   (default: .venv)
# Idempotent: a second run re-checks and installs only what is missing.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$here/.venv}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

cons="$here/scripts/constraints-cpu.txt"
log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [ ! -x "$venv/bin/python" ]; then
  log "creating venv $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$cons")

log "torch 2.13.0 (the CPU build where a local index has it; from PyPI alone the CUDA build, which runs on CPU too)"
"${pip[@]}" torch==2.13.0
log "sglang's light dependencies"
"${pip[@]}" -r "$here/scripts/requirements-cpu.txt"
log "sglang 0.5.17 (--no-deps)"
"${pip[@]}" --no-deps sglang==0.5.17
log "torchvision 0.28.0 (--no-deps; its C++ ops are shimmed, test env only)"
"${pip[@]}" --no-deps torchvision==0.28.0
log "sglang-sparse (editable) + the test-only CPU runtime"
"${pip[@]}" --no-deps --no-build-isolation -e "$here"
"${pip[@]}" --no-deps --no-build-isolation -e "$here/tests/cpu_runtime"
log "torchvision shim (.pth, test env only)"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/tests/cpu_runtime/sglang_sparse_cpu_torchvision_shim.pth" "$site/"
log "check"
OMP_NUM_THREADS=1 "$venv/bin/python" - <<'PY'
import torch, sglang, importlib.metadata as md
import sglang_sparse
print("torch", torch.__version__, "| sglang", md.version("sglang"), "| sglang-sparse", md.version("sglang-sparse"))
PY
log "done: $venv"
