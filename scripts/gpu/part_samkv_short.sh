#!/usr/bin/env bash
# SamKV on many short documents, on the device after the kit is staged (env sourced, models/SmolLM2-135M-Instruct
# linked to $KIT_MODEL):
#
#   bash scripts/gpu/part_samkv_short.sh REPORT_DIR
#
# Steps (each one's failure is recorded in REPORT_DIR/steps.txt, never fatal):
#   pytest_gpu   tests/test_gpu_samkv_server.py + the selection / budget unit tests (SHORT_PYTEST=0 skips it)
#   server       one `--sparse samkv` server at its defaults (FlashInfer), port 30030
#   short_N      python -m bench.samkv_short_docs for each "DOCS:WORDS" of SHORT_SETS (default
#                "24:120 12:250 8:400 4:800"; SHORT_ITEMS items each; SHORT_DISTRACTORS=1: a fact in every document):
#                answers of the samkv pipeline, recompute, the server's choice and the inline prompt
#                -> REPORT_DIR/short_DOCSxWORDS/samkv_short_docs.{md,json}
# The server is stopped by its own process group.
set -uo pipefail
rep=${1:?usage: part_samkv_short.sh REPORT_DIR}
mkdir -p "$rep"
export PYTHONUNBUFFERED=1
rc=0
part=gpu_part_samkv_short
# shellcheck disable=SC1091
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
port=${SHORT_PORT:-30030}
[ "${SHORT_PYTEST:-1}" = 0 ] || step pytest_gpu timeout "${SHORT_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rA \
    tests/test_gpu_samkv_server.py tests/test_samkv_score.py tests/test_samkv_front_door.py

say "== server (samkv, defaults)"
setsid python3 -m sglang.launch_server --model-path models/SmolLM2-135M-Instruct --dtype bfloat16 --host 127.0.0.1 \
    --port "$port" --attention-backend flashinfer --mem-fraction-static 0.5 --sparse samkv \
    > "$rep/server.log" 2>&1 &
pid=$!
stop_server() { [ -n "${pid:-}" ] && kill -- -"$pid" 2>/dev/null; sleep 2; [ -n "${pid:-}" ] && kill -9 -- -"$pid" 2>/dev/null; pid=; }
trap stop_server EXIT
ready=0
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ready=1; break; fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 1
done
if [ "$ready" != 1 ]; then
  say "server did not start"; tail -n 40 "$rep/server.log"; exit 1
fi
say "server ready"
extra=()
[ "${SHORT_DISTRACTORS:-0}" = 1 ] && extra=(--distractors)
for set in ${SHORT_SETS:-24:120 12:250 8:400 4:800}; do
  d=${set%%:*}; w=${set##*:}
  step "short_${d}x${w}" timeout "${SHORT_SET_TIMEOUT:-150}" python3 -m bench.samkv_short_docs \
      --url "http://127.0.0.1:$port" --docs "$d" --doc-words "$w" --items "${SHORT_ITEMS:-30}" \
      --out "$rep/short_${d}x${w}" "${extra[@]}"
done
stop_server
exit $rc
