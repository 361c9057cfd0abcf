# stop 20, fifth machine (after stage 3): sparse prefill break-even contexts (for min_context's default)
set -o pipefail
bash .dev/device.sh stage 3 || exit 3
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
R=/tmp/m5; mkdir -p $R
timeout 400 python3 bench/loopserve_prefill_bench.py --out $R/breakeven --contexts 8192,12288,16384,24576,65536 > $R/prefill.log 2>&1; echo "prefill rc $?" | tee -a $R/steps.txt
sed -n '/^| case | ctx | heads/,$p' $R/breakeven/loopserve_prefill.md | cut -c1-200
tar czf $OUT/m5.tgz -C /tmp m5
