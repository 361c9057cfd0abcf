#!/usr/bin/env bash
# One GPU session's runs, in as few device calls as possible (see ../shared/device/README.md).
# Run on the device from the repository root after the kit's last stage:
#
#   bash scripts/gpu/session.sh foundation   # gpu_check.sh: server with flashinfer, chat, pytest -m gpu
#   bash scripts/gpu/session.sh bench        # dense harness baseline + PSA kernel benchmark
#   bash scripts/gpu/session.sh psa_tests    # pytest -m gpu (kernels + the psa server on FlashInfer)
#   bash scripts/gpu/session.sh psa_bench    # PSA kernel benchmark + harness fidelity off vs psa
#   bash scripts/gpu/session.sh psa_load     # SGLang serving benchmark, off vs psa, long inputs
#   bash scripts/gpu/session.sh gpu_tests    # pytest -m gpu on GPU_TEST_ARGS only
#   bash scripts/gpu/session.sh tests_host   # pytest -m gpu (every GPU test) + scripts/gpu/part_host_tier.sh
#   bash scripts/gpu/session.sh loopserve    # scripts/gpu/part_loopserve.sh (prefill bench, harness, fidelity)
#   bash scripts/gpu/session.sh samkv        # scripts/gpu/part_samkv.sh (GPU tests, accuracy + TTFT sets, 8B dummy TTFT)
#   bash scripts/gpu/session.sh host_conc    # bench/host_tier_concurrency.py (dense vs psa + host tier vs HiCache)
#   bash scripts/gpu/session.sh decode       # sparse-decode kernel tests + bench/sparse_decode_bench.py + bench/decode_profile.py
#   bash scripts/gpu/session.sh ws_overhead  # bench.load off vs psa + host tier, working-set admission on / off (TPOT cost)
#
# Reports land in /tmp/gpu_reports/<part>/ and are packed into $OUT/<part>_reports.tgz
# (the device returns at most 8 files from $OUT); each part's log is also copied to $OUT.
set -uo pipefail
part=${1:?usage: gpu_session.sh foundation|bench|psa_tests|psa_bench|psa_load|gpu_tests|tests_host|loopserve|samkv|host_conc|decode|ws_overhead}
out=${OUT:-$PWD/gpu_out}
rep=/tmp/gpu_reports/$part
mkdir -p "$out" "$rep"
# shellcheck disable=SC1091
source /tmp/kit/env.sh
# this checkout first: the kit installed a copy of the project at stage 3, and later calls carry newer code
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# the repo-relative default model path (models/ is not carried) -> the kit's converted model
mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct
say() { echo "[gpu_session $(date +%H:%M:%S)] $*"; }
rc=0
step() {  # step NAME CMD...: run with its log in the report folder; a failure is recorded, not fatal
  local name=$1; shift
  say "== $name"
  local t0=$(date +%s)
  "$@" 2>&1 | tee "$rep/$name.log"
  local src=${PIPESTATUS[0]}
  say "== $name: exit $src in $(( $(date +%s) - t0 ))s"
  [ "$src" = 0 ] || rc=1
}
case $part in
  foundation)
    step gpu_check env OUT="$rep" bash scripts/gpu/check.sh
    bash /tmp/kit/device.sh save-cache || true   # kernels compiled here -> $OUT/kcache_N.tgz
    ;;
  bench)
    if [ -f scripts/gpu/harness_driver_cmd.sh ]; then step harness_dense bash scripts/gpu/harness_driver_cmd.sh "$rep"; fi
    if [ -f bench/psa_decode_bench.py ]; then
      step psa_decode timeout "${PSA_BENCH_TIMEOUT:-300}" python3 bench/psa_decode_bench.py --out "$rep" ${PSA_BENCH_ARGS:-}
    fi
    bash /tmp/kit/device.sh save-cache || true   # kernels compiled here -> $OUT/kcache_N.tgz
    ;;
  psa_tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    step pytest_gpu timeout "${PSA_TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
        --junitxml="$rep/junit_gpu.xml" tests
    bash /tmp/kit/device.sh save-cache || true
    ;;
  psa_bench)
    step psa_decode timeout "${PSA_BENCH_TIMEOUT:-240}" python3 bench/psa_decode_bench.py --out "$rep" ${PSA_BENCH_ARGS:-}
    step harness_psa timeout "${PSA_HARNESS_TIMEOUT:-300}" python3 -m bench.run_harness --preset "${BENCH_PRESET:-full}" \
        --modes off,psa --sparse-config "psa={\"min_context\": ${PSA_MIN_CONTEXT:-256}}" --device cuda \
        --python python3 --model "$KIT_MODEL" --port 30000 --out "$rep/gpu_psa" \
        --server-args "--attention-backend flashinfer --page-size 16"
    step psa_fidelity python3 -m bench.psa_fidelity --run "$rep/gpu_psa" --out "$rep/psa_fidelity.json"
    ;;
  psa_load)
    step load_psa timeout "${PSA_LOAD_TIMEOUT:-420}" python3 -m bench.load --modes off,psa --device cuda \
        --python python3 --model "$KIT_MODEL" --port 30001 --concurrency "${BENCH_LOAD_CONCURRENCY:-1,8,32}" \
        --input-len "${PSA_LOAD_INPUT:-6000}" --output-len 128 --out "$rep/gpu_load_psa" \
        --sparse-config "psa={\"min_context\": 2048}" --server-args "--attention-backend flashinfer --page-size 16"
    ;;
  ws_overhead)  # TPOT of psa + host tier with the working-set tracker recording (admission on, a unit cache that
                # does not bind) vs off: what recording costs on the decode hot path (off is each run's baseline)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    for adm in true false; do
      step "load_ws_$adm" timeout "${WS_LOAD_TIMEOUT:-300}" python3 -m bench.load --modes off,psa --device cuda \
          --python python3 --model "$KIT_MODEL" --port 30001 --concurrency "${WS_LOAD_CONCURRENCY:-1,4}" \
          --input-len "${WS_LOAD_INPUT:-6000}" --output-len 128 --out "$rep/load_ws_$adm" \
          --sparse-config "psa={\"min_context\": 2048, \"host_tier_gb\": 1, \"gpu_cache_mb\": 2048, \"working_set_admission\": $adm}" \
          --server-args "--attention-backend flashinfer --page-size 16 --mem-fraction-static 0.3"
    done
    ;;
  gpu_tests)  # pytest -m gpu on GPU_TEST_ARGS (default tests) alone, with --durations
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    step pytest_gpu${GPU_TEST_TAG:-} timeout "${GPU_TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        -rA --durations=15 --junitxml="$rep/junit_gpu${GPU_TEST_TAG:-}.xml" ${GPU_TEST_ARGS:-tests}
    ;;
  tests_host)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    step pytest_gpu timeout "${GPU_TEST_TIMEOUT:-420}" python3 -m pytest -m gpu -q -p no:cacheprovider -rA \
        --junitxml="$rep/junit_gpu.xml" ${GPU_TEST_ARGS:-tests}
    if [ -f scripts/gpu/part_host_tier.sh ]; then step host_tier bash scripts/gpu/part_host_tier.sh "$rep/host_tier"; fi
    ;;
  loopserve)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    step loopserve bash scripts/gpu/part_loopserve.sh "$rep/loopserve"
    ;;
  samkv)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    step samkv bash scripts/gpu/part_samkv.sh "$rep/samkv"
    ;;
  host_conc)  # the end-to-end concurrency benchmark alone, merged into a copy of the committed host_tier.json
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    cp bench/results/host_tier.json "$rep/host_tier.json"
    step host_tier_concurrency timeout -k 30 "${HTC_TIMEOUT:-540}" python3 bench/host_tier_concurrency.py \
        --out "$rep/host_tier_concurrency" --merge-into "$rep/host_tier.json" --time-budget "${HTC_BUDGET:-480}" \
        ${HTC_ARGS:-}  # e.g. HTC_ARGS="--servers dense,psa_host_tier": three server starts need HTC_BUDGET >= ~420
    ;;
  decode)  # LoopServe / lastwindow decode speed: DEC_STEPS picks (default: pytest_kernels kernel_bench profile;
           # step_bench: bench/loopserve_step_bench.py, the runner's eager step alone)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$rep/gpu.txt"
    dsteps=${DEC_STEPS:-pytest_kernels kernel_bench profile}
    case " $dsteps " in *" pytest_kernels "*)
      step pytest_kernels timeout "${DEC_TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -v -p no:cacheprovider -rA \
          --durations=10 --junitxml="$rep/junit_gpu_decode.xml" tests/flashinfer_ext/test_split_decode.py \
          tests/flashinfer_ext/test_sparse_decode.py tests/flashinfer_ext/test_loopserve_reselect.py \
          tests/flashinfer_ext/test_vs_decode_batched.py tests/flashinfer_ext/test_list_union.py \
          tests/flashinfer_ext/test_vs_estimate_batched.py ;;
    esac
    case " $dsteps " in *" step_bench "*)
      step step_bench timeout "${DEC_STEP_TIMEOUT:-240}" python3 bench/loopserve_step_bench.py --out "$rep" ;;
    esac
    case " $dsteps " in *" kernel_bench "*)
      step kernel_bench timeout "${DEC_BENCH_TIMEOUT:-180}" python3 bench/sparse_decode_bench.py --out "$rep" ;;
    esac
    case " $dsteps " in *" profile "*)
      step decode_profile timeout "${DEC_PROFILE_TIMEOUT:-300}" python3 -m bench.decode_profile --device cuda \
          --modes "${DEC_MODES:-off,lastwindow,loopserve}" --prompt-tokens 2000 --max-tokens 96 --steps 48 \
          --out "$rep/decode_profile${DEC_TAG:-}" \
          --sparse-config 'loopserve={"min_context": 128, "budget": 64, "alpha": 0.97}' \
          --sparse-config 'lastwindow={"min_context": 128, "budget": 128}' \
          --server-args "--attention-backend flashinfer --page-size 16 --mem-fraction-static 0.3 ${DEC_SERVER_ARGS:---disable-cuda-graph}" ;;
    esac
    ;;
  *) say "unknown part $part"; exit 2 ;;
esac
tar czf "$out/${part}_reports.tgz" -C /tmp/gpu_reports "$part"
ls -la "$out"
say "part $part done: exit $rc"
exit $rc
