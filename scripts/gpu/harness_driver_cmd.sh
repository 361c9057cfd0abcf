#!/usr/bin/env bash
# GPU hook called by scripts/gpu/session.sh (part "bench") after the device kit's last
# stage, from the repository root:  bash scripts/gpu/harness_driver_cmd.sh REPORT_DIR
# 1. dense baseline: python -m bench.run_harness --preset full on CUDA with FlashInfer
#    -> REPORT_DIR/gpu_dense/ (report.md, PNGs if matplotlib exists, baseline_dense.json, raw/)
# 2. load driver: SGLang's serving benchmark at concurrencies 1,8,32 -> REPORT_DIR/gpu_load/
# Knobs (env): BENCH_PRESET (full), BENCH_SERVER_ARGS ('--attention-backend flashinfer'),
# BENCH_MODES (off), BENCH_LOAD (1 = run the load driver), BENCH_LOAD_CONCURRENCY (1,8,32),
# BENCH_HARNESS_TIMEOUT (540 s), BENCH_LOAD_TIMEOUT (420 s). Exit 1 if either part failed.
set -uo pipefail
rep=${1:?usage: bash scripts/gpu/harness_driver_cmd.sh REPORT_DIR}
py=${BENCH_PYTHON:-python3}
model=${BENCH_MODEL:-${KIT_MODEL:-/tmp/models/SmolLM2-135M-Instruct}}
sargs=${BENCH_SERVER_ARGS:---attention-backend flashinfer}
rc=0
timeout "${BENCH_HARNESS_TIMEOUT:-540}" "$py" -m bench.run_harness --preset "${BENCH_PRESET:-full}" \
    --modes "${BENCH_MODES:-off}" --device cuda --python "$py" --model "$model" --port 30000 \
    --out "$rep/gpu_dense" --server-args "$sargs" || rc=1
if [ "${BENCH_LOAD:-1}" = 1 ]; then
  timeout "${BENCH_LOAD_TIMEOUT:-420}" "$py" -m bench.load --modes "${BENCH_MODES:-off}" --device cuda \
      --python "$py" --model "$model" --port 30001 --concurrency "${BENCH_LOAD_CONCURRENCY:-1,8,32}" \
      --input-len 2048 --output-len 128 --out "$rep/gpu_load" --server-args "$sargs" || rc=1
fi
exit $rc
