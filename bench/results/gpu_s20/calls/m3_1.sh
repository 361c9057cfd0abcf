# stop 20, third machine, call 1 (after stage 3): kernel tests, prefill bench (+ SmolLM2 capture), step bench
set -o pipefail
bash .dev/device.sh stage 3 || exit 3
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
R=/tmp/m3; mkdir -p $R
timeout 200 python3 -m pytest -m gpu -v -p no:cacheprovider -rA tests/flashinfer_ext/test_vs_split_search.py tests/flashinfer_ext/test_vs_select.py tests/flashinfer_ext/test_vs_prefill.py tests/flashinfer_ext/test_vs_estimate.py tests/flashinfer_ext/test_vs_estimate_batched.py tests/flashinfer_ext/test_loopserve_reselect.py > $R/pytest_kernels.log 2>&1; echo "pytest rc $?" | tee -a $R/steps.txt
grep -E "passed|failed|FAILED|Error" $R/pytest_kernels.log | tail -6
timeout 300 python3 bench/loopserve_prefill_bench.py --out $R/prefill --smollm --time-budget 70 > $R/prefill.log 2>&1; echo "prefill rc $?" | tee -a $R/steps.txt
sed -n '/^| case | ctx | heads/,$p' $R/prefill/loopserve_prefill.md | grep -v skipped | cut -c1-330
timeout 120 python3 bench/loopserve_step_bench.py --out $R/step --iters 10 > $R/step.log 2>&1; echo "step rc $?" | tee -a $R/steps.txt
sed -n '/^| case | kind/,/^Re-selecting/p' $R/step/loopserve_step.md
tar czf $OUT/m3_1.tgz -C /tmp m3
