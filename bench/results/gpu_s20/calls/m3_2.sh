# stop 20, third machine, call 2: the LoopServe harness (headline preset, off + loopserve) + fidelity JSON
set -o pipefail
LS_PRESET=headline LS_MODES=off,loopserve LS_STEPS="harness fidelity" LS_LW_BUDGET=128 LS_HARNESS_TIMEOUT=540 \
  LS_LW_RUN=bench/results/gpu_s19/loopserve_headline/off_lastwindow bash scripts/gpu_session.sh loopserve
