set -o pipefail
bash .dev/device.sh stage 3 || exit 3
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
R=/tmp/rep; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $R/gpu.txt
timeout 220 python3 -m pytest -m gpu -v -p no:cacheprovider -rA tests/flashinfer_ext/test_vs_estimate.py tests/flashinfer_ext/test_vs_estimate_batched.py tests/flashinfer_ext/test_loopserve_reselect.py > $R/pytest_kernels.log 2>&1; echo "pytest rc $?" | tee -a $R/steps.txt
tail -5 $R/pytest_kernels.log
timeout 250 python3 bench/loopserve_prefill_bench.py --out $R/prefill --time-budget 0 > $R/prefill.log 2>&1; echo "prefill rc $?" | tee -a $R/steps.txt
tail -22 $R/prefill/loopserve_prefill.md
tar czf $OUT/callA.tgz -C /tmp rep
