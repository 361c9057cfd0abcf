# second call on the same machine (no carry): the LoopServe step bench (split vs unsplit LSE pass)
set -o pipefail
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
R=/tmp/repB; mkdir -p $R
timeout 500 python3 bench/loopserve_step_bench.py --out $R/step --iters 10 > $R/step.log 2>&1; echo "step rc $?" | tee -a $R/steps.txt
tail -30 $R/step/loopserve_step.md
tar czf $OUT/callB.tgz -C /tmp repB
