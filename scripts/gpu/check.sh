#!/usr/bin/env bash
# Foundation check on the lent GPU machine, after the device kit's last stage
# (../shared/device/README.md). From the repository root on the device:
#
#   bash scripts/gpu/check.sh            # writes reports under $OUT (or ./gpu_check_out)
#
# It (1) installs the project into the kit (its sglang.srt.plugins entry point registers),
# (2) starts the server on the kit's model with --attention-backend flashinfer --sparse off,
# (3) gets a chat completion and reads the plugin state from /server_info, (4) stops that
# server by its process group, (5) runs `pytest -m gpu`. Exit code: non-zero if any step failed.
set -uo pipefail
out=${OUT:-$PWD/gpu_check_out}
mkdir -p "$out"
kit=/tmp/kit
[ -f $kit/env.sh ] || { echo "[gpu_check] the device kit is not staged (no $kit/env.sh)"; exit 3; }
# shellcheck disable=SC1091
source $kit/env.sh
say() { echo "[gpu_check $(date +%H:%M:%S)] $*"; }
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/[gpu_check] GPU: /'
python3 -c "import torch, sglang, flashinfer; print('[gpu_check] torch', torch.__version__, '| sglang', sglang.__version__, '| flashinfer', flashinfer.__version__)"

# the server tests use tests/serverproc.DEFAULT_MODEL (models/SmolLM2-135M-Instruct): the kit's converted model
[ -e models/SmolLM2-135M-Instruct ] || { mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct; }

say "installing the project into the kit"
bash $kit/device.sh project || { say "project install FAILED"; exit 4; }

say "starting the server: --attention-backend flashinfer --sparse off"
t0=$(date +%s)
if bash $kit/device.sh serve --attention-backend flashinfer --sparse off --mem-fraction-static 0.3; then
  say "server start took $(( $(date +%s) - t0 ))s (kit serve, including FlashInfer JIT/cache restore)"
  port=${KIT_PORT:-30000}
  say "chat completion:"
  curl -sS -m 120 http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"default","messages":[{"role":"user","content":"What is the capital of France?"}],"max_tokens":32,"temperature":0}' \
    | tee "$out/chat_completion.json" || rc=1
  echo
  python3 - "$port" <<'PY' || rc=1
import json, sys, urllib.request
info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/server_info", timeout=60))
state = info["internal_states"][0]["sparse"]
print("[gpu_check] main process: sparse =", info["sparse"], "sparse_config =", info["sparse_config"])
print("[gpu_check] scheduler process:", json.dumps(state))
assert info["sparse"] == "off" and state["mode"] == "off" and state["attention_backend_mode"] == "off", state
assert state["attention_backend"] == "FlashInferAttnBackend", state["attention_backend"]
PY
else
  say "server FAILED to start"; rc=1
fi
cp $kit/serve/server.log "$out/server.log" 2>/dev/null || true
bash $kit/device.sh stop || true

say "pytest -m gpu"
python3 -m pytest -m gpu -q -p no:cacheprovider --junitxml="$out/junit_gpu.xml" tests 2>&1 | tee "$out/pytest_gpu.log"
prc=${PIPESTATUS[0]}
[ "$prc" = 0 ] || [ "$prc" = 5 ] || rc=1   # 5: no gpu tests collected
say "done, exit code $rc"
exit $rc
