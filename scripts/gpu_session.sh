#!/usr/bin/env bash
# One GPU session's runs, in as few device calls as possible (see ../shared/device/README.md).
# Run on the device from the repository root after the kit's last stage:
#
#   bash scripts/gpu_session.sh foundation   # gpu_check.sh: server with flashinfer, chat, pytest -m gpu
#   bash scripts/gpu_session.sh bench        # dense harness baseline + PSA kernel benchmark
#
# Reports land in /tmp/gpu_reports/<part>/ and are packed into $OUT/<part>_reports.tgz
# (the device returns at most 8 files from $OUT); each part's log is also copied to $OUT.
set -uo pipefail
part=${1:?usage: gpu_session.sh foundation|bench}
out=${OUT:-$PWD/gpu_out}
rep=/tmp/gpu_reports/$part
mkdir -p "$out" "$rep"
# shellcheck disable=SC1091
source /tmp/kit/env.sh
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
    step gpu_check env OUT="$rep" bash scripts/gpu_check.sh
    bash /tmp/kit/device.sh save-cache || true   # kernels compiled here -> $OUT/kcache_N.tgz
    ;;
  bench)
    if [ -f bench/harness_driver_cmd.sh ]; then step harness_dense bash bench/harness_driver_cmd.sh "$rep"; fi
    if [ -f bench/psa_decode_bench.py ]; then
      step psa_decode timeout "${PSA_BENCH_TIMEOUT:-300}" python3 bench/psa_decode_bench.py --out "$rep" ${PSA_BENCH_ARGS:-}
    fi
    bash /tmp/kit/device.sh save-cache || true   # kernels compiled here -> $OUT/kcache_N.tgz
    ;;
  *) say "unknown part $part"; exit 2 ;;
esac
tar czf "$out/${part}_reports.tgz" -C /tmp/gpu_reports "$part"
ls -la "$out"
say "part $part done: exit $rc"
exit $rc
