#!/usr/bin/env bash
# The project's test command (README, .ci/run): sets up the CPU test environment if needed,
# builds the default model if needed, then runs every CPU test (GPU tests skip cleanly).
# Extra arguments go to pytest, e.g. `bash scripts/test_cpu.sh -k sparse_args`; PYTEST_WORKERS=0 runs the tests
# in one process (default: 2 workers). The 25 slowest tests are listed at the end.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
t0=$(date +%s)
bash scripts/setup_cpu_env.sh
OMP_NUM_THREADS=1 .venv/bin/python -m sglang_sparse.tools.build_model --out models/SmolLM2-135M-Instruct --dtype bfloat16
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rc=0
# two pytest workers (one per core of the 2-core box); a test file stays on one worker, so its module-scoped
# servers are started once. PYTEST_WORKERS=0 runs everything in this process.
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=25 "$@" || rc=$?
echo "[test_cpu] pytest exit code $rc; total wall time $(( $(date +%s) - t0 ))s"
exit $rc
