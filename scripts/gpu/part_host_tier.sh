#!/usr/bin/env bash
# Host tier (issue #6) GPU part: the host-transfer GPU tests, the host-tier server test (evict -> host ->
# reload on FlashInfer, page 16), the transfer benchmark and the end-to-end concurrency benchmark (dense vs
# psa + host tier vs HiCache at the same --mem-fraction-static / KV pool; merges concurrency_ratio_vs_dense
# into REPORT_DIR/host_tier.json).
# Run on the device from the repository root with the kit's env already sourced
# (scripts/gpu/session.sh tests_host calls it):  bash scripts/gpu/part_host_tier.sh REPORT_DIR
# Reports: REPORT_DIR/{pytest_host_tier.log,junit_host_tier.xml,pytest_host_tier_server.log,junit_host_tier_server.xml,host_tier_bench.log,host_tier.md,host_tier.json,
#          host_tier_concurrency.log,host_tier_concurrency/{host_tier_concurrency.md,host_tier_concurrency.json,server_*.log}}.
# A failing step is recorded (exit code in the log and status.txt), never fatal; total <= ~19 minutes
# (the end-to-end step alone: 420 s budget, killed at 480 s).
set -uo pipefail
rep=${1:?usage: gpu_part_host_tier.sh REPORT_DIR}
mkdir -p "$rep"
export PYTHONUNBUFFERED=1
rc=0
say() { echo "[host_tier $(date +%H:%M:%S)] $*" | tee -a "$rep/status.txt"; }
say "python $(python3 -c 'import torch, triton; print(torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")' 2>&1)"
t0=$(date +%s)
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rA --junitxml="$rep/junit_host_tier.xml" \
    tests/flashinfer_ext/test_host_transfer.py tests/flashinfer_ext/test_kv_units.py 2>&1 | tee "$rep/pytest_host_tier.log"
s=${PIPESTATUS[0]}; say "pytest host_transfer (gpu): exit $s in $(( $(date +%s) - t0 ))s"; [ "$s" = 0 ] || rc=1
t0=$(date +%s)
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rA --junitxml="$rep/junit_host_tier_server.xml" \
    tests/test_gpu_host_tier_server.py 2>&1 | tee "$rep/pytest_host_tier_server.log"
s=${PIPESTATUS[0]}; say "pytest host tier server (gpu): exit $s in $(( $(date +%s) - t0 ))s"; [ "$s" = 0 ] || rc=1
t0=$(date +%s)
timeout 240 python3 bench/host_tier_bench.py --out "$rep" 2>&1 | tee "$rep/host_tier_bench.log"
s=${PIPESTATUS[0]}; say "host_tier_bench: exit $s in $(( $(date +%s) - t0 ))s"; [ "$s" = 0 ] || rc=1
t0=$(date +%s)
timeout -k 30 480 python3 bench/host_tier_concurrency.py --out "$rep/host_tier_concurrency" \
    --merge-into "$rep/host_tier.json" --time-budget 420 2>&1 | tee "$rep/host_tier_concurrency.log"
s=${PIPESTATUS[0]}; say "host_tier_concurrency: exit $s in $(( $(date +%s) - t0 ))s"; [ "$s" = 0 ] || rc=1
say "done: exit $rc"
exit $rc
