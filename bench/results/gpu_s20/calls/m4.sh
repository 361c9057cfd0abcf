# stop 20, fourth machine (after stage 3): the same harness at concurrency 4 (batch composition differs from 8)
set -o pipefail
bash .dev/device.sh stage 3 || exit 3
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
R=/tmp/m4; mkdir -p $R
timeout 500 python3 -m bench.run_harness --preset headline --modes off,loopserve --fidelity-probes 0 --concurrency 4 \
  --sparse-config 'loopserve={"min_context": 128, "budget": 64, "alpha": 0.97}' --device cuda --python python3 \
  --model "$KIT_MODEL" --port 30000 --out $R/c4_off_loopserve --server-args "--attention-backend flashinfer --page-size 16" \
  > $R/harness.log 2>&1; echo "harness rc $?" | tee -a $R/steps.txt
tail -4 $R/harness.log
tar czf $OUT/m4.tgz -C /tmp m4
