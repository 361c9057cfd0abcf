#!/usr/bin/env bash
# LoopServe's GPU part (issue 5), called on the device by `scripts/gpu/session.sh loopserve` after
# the kit is staged (env sourced, $KIT_MODEL set, models/SmolLM2-135M-Instruct linked to it):
#
#   bash scripts/gpu/part_loopserve.sh REPORT_DIR
#
# Steps (each one's failure is recorded in REPORT_DIR/steps.txt, never fatal); LS_STEPS picks them
# (default all four; the device allows 10 minutes a command, so run the harness on its own call:
#   LS_STEPS="pytest_gpu prefill_bench" bash scripts/gpu/session.sh loopserve      # ~4 minutes
#   LS_STEPS="harness fidelity" bash scripts/gpu/session.sh loopserve              # <= 8 minutes
# ):
#   pytest_gpu    the loopserve GPU server tests + the vertical/slash/decode kernel tests (-m gpu; the
#                 lastwindow GPU server test runs with `pytest -m gpu tests`, the harness serves lastwindow here)
#   prefill_bench bench/loopserve_prefill_bench.py -> loopserve_prefill.{md,json,png}
#   harness       bench.run_harness off,loopserve,lastwindow on FlashInfer (page 16)
#   fidelity      bench.loopserve_fidelity -> loopserve_fidelity.json
# Budgets: LS_TEST_TIMEOUT (420 s: on a machine without kept kernel caches the first GPU server test compiles
# FlashInfer cold, and 380 s ran out after the 13 kernel tests on 2026-11-23), LS_BENCH_TIMEOUT (240 s: on 2026-11-24 150 s ran out while the --smollm case loaded the model, after the
# 128k/32k/4k cases had taken ~140 s with warm caches; the bench
# itself always runs its headline contexts + --smollm, LS_BENCH_BUDGET bounds the rest), LS_HARNESS_TIMEOUT
# (480 s; 2026-11-23 with warm caches: off 95 s, loopserve 246 s, lastwindow 141 s = 509 s in all). The H100 run
# of the harness (full preset, 378 tasks, concurrency 8): off 81 s in all (server start 57 s, tasks 9 s,
# 30 probes 9 s), loopserve start 53 s + tasks 180 s + 30 probes > 140 s (~2678-token probes, killed),
# so LS_PROBES (4) runs the first 4 of the preset's 30 fidelity probes (--fidelity-probes; the same
# probes in every mode): off ~75 s + loopserve ~260 s + lastwindow (one selection per request) ~110 s.
# loopserve runs before lastwindow so that a timeout costs the baseline, not the headline;
# bench.loopserve_fidelity --lastwindow-run DIR takes lastwindow from a second run (off,lastwindow) if needed;
# LS_PRESET (full; `headline`: the short headline kinds only with 3x the seeds, 210 tasks per question
# position), LS_MODES (off,loopserve,lastwindow; a run too long for one call splits into off,loopserve and
# off,lastwindow, and `bench.loopserve_fidelity --run A --lastwindow-run B` combines them, anywhere),
# LS_LW_RUN (the fidelity step's --lastwindow-run), LS_MIN_CONTEXT (128: the harness headline contexts are ~130-450 tokens),
# LS_BUDGET (64: top-B per KV head for loopserve at those contexts; the harness run and the fidelity JSON are
# named by it, gpu_loopserve_b<B>/ and loopserve_fidelity_b<B>.json), LS_LW_BUDGET (lastwindow's budget, default
# LS_BUDGET: at 64 the H100 run of 2026-11-23 lost the needle's last digit even with the question at the end,
# 0.30/0.27/0.19; the CPU harness, preset cpu, showed the position effect at 128: 0.57/0.31/0.78 of dense), LS_ALPHA
# (0.97: on SmolLM2-135M the paper's 0.955 lost a planted fact that 0.97 kept, tests/test_loopserve_server.py).
set -uo pipefail
rep=${1:?usage: gpu_part_loopserve.sh REPORT_DIR}
mkdir -p "$rep"
export PYTHONUNBUFFERED=1
rc=0
part=gpu_part_loopserve
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
mc=${LS_MIN_CONTEXT:-128}
budget=${LS_BUDGET:-64}
lw_budget=${LS_LW_BUDGET:-$budget}
preset=${LS_PRESET:-full}
modes=${LS_MODES:-off,loopserve,lastwindow}
run=b$budget; [ "$lw_budget" = "$budget" ] || run=${run}_lw$lw_budget
[ "$preset" = full ] || run=${run}_$preset
[ "$modes" = off,loopserve,lastwindow ] || run=${run}_$(echo "$modes" | tr , _)
alpha=${LS_ALPHA:-0.97}
steps=${LS_STEPS:-pytest_gpu prefill_bench harness fidelity}
want() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# kernels first (seconds), then the server module (two servers, ~1 min to start each on an H100)
want pytest_gpu && step pytest_gpu timeout "${LS_TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -v -p no:cacheprovider -rA --durations=15 \
    --junitxml="$rep/junit_gpu_loopserve.xml" tests/flashinfer_ext/test_vs_estimate.py \
    tests/flashinfer_ext/test_vs_select.py tests/flashinfer_ext/test_vs_prefill.py \
    tests/flashinfer_ext/test_vs_decode_batched.py tests/flashinfer_ext/test_vs_estimate_batched.py \
    tests/flashinfer_ext/test_loopserve_reselect.py tests/test_gpu_loopserve_server.py tests/test_gpu_lastwindow_server.py
want prefill_bench && step prefill_bench timeout "${LS_BENCH_TIMEOUT:-240}" python3 bench/loopserve_prefill_bench.py --out "$rep" \
    --smollm --time-budget "${LS_BENCH_BUDGET:-75}"
want harness && step harness timeout "${LS_HARNESS_TIMEOUT:-480}" python3 -m bench.run_harness \
    --preset "$preset" --modes "$modes" --fidelity-probes "${LS_PROBES:-4}" \
    --sparse-config "loopserve={\"min_context\": $mc, \"budget\": $budget, \"alpha\": $alpha}" \
    --sparse-config "lastwindow={\"min_context\": $mc, \"budget\": $lw_budget}" \
    --device cuda --python python3 --model "$KIT_MODEL" --port 30000 --out "$rep/gpu_loopserve_$run" \
    --server-args "--attention-backend flashinfer --page-size 16"
# LS_LW_RUN: a second harness dir (modes off,lastwindow) whose lastwindow figures the JSON takes
want fidelity && step fidelity python3 -m bench.loopserve_fidelity --run "$rep/gpu_loopserve_$run" \
    ${LS_LW_RUN:+--lastwindow-run "$LS_LW_RUN"} --out "$rep/loopserve_fidelity_$run.json"
say "done: exit $rc"
exit $rc
