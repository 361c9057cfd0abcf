# stop 20, sixth machine (after stage 3), after the review: the sums pass's multi-row-block path now sums like the
# one-row-block path (_block_vsum); lastwindow (window 32 = two row blocks) takes that path: kernel tests + its harness
set -o pipefail
bash .dev/device.sh stage 3 || exit 3
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
R=/tmp/m6; mkdir -p $R
timeout 150 python3 -m pytest -m gpu -v -p no:cacheprovider -rA tests/flashinfer_ext/test_vs_estimate_batched.py tests/flashinfer_ext/test_vs_estimate.py tests/flashinfer_ext/test_loopserve_reselect.py > $R/pytest_kernels.log 2>&1; echo "pytest rc $?" | tee -a $R/steps.txt
grep -E "passed|failed" $R/pytest_kernels.log | tail -2
LS_PRESET=headline LS_MODES=off,lastwindow LS_STEPS=harness LS_LW_BUDGET=128 LS_HARNESS_TIMEOUT=400 \
  bash scripts/gpu_session.sh loopserve > $R/loopserve_part.log 2>&1; echo "harness rc $?" | tee -a $R/steps.txt
grep -E "accuracy by position|tasks\] 420" $R/loopserve_part.log | tail -4
cp -r /tmp/gpu_reports/loopserve/loopserve/gpu_loopserve_b64_lw128_headline_off_lastwindow $R/ 2>/dev/null
tar czf $OUT/m6.tgz -C /tmp m6
