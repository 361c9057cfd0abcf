#!/usr/bin/env bash
# Long-context testbed runs on the lent GPU (after the device kit's last stage; see scripts/gpu/README.md).
# Run from the repository root on the device:
#
#   bash scripts/gpu/testbed.sh needle   # testbed folders (32k, 64k) + dense needle table by length and depth
#   bash scripts/gpu/testbed.sh long     # `long` preset: off + every mode at defaults, servers side by side
#   bash scripts/gpu/testbed.sh samkv    # bench.samkv_rag: every variant vs the stock inline prompt, TTFT 8 x 3k
#   bash scripts/gpu/testbed.sh samkvplain  # samkv's plain requests against off: bench.load 4k / 32k x 1 / 8 / 32
#   bash scripts/gpu/testbed.sh samkvtests  # samkv's GPU server tests
#   bash scripts/gpu/testbed.sh e2e      # bench.load grid: 4k/16k/32k x concurrency 1/8/32, off + every mode
#                                        # (a fresh machine compiles kernels at the first servers' start, ~2 min:
#                                        #  TESTBED_MODES=off,psa,loopserve then off,lastwindow,samkv fit a call each)
#   bash scripts/gpu/testbed.sh reliability-start   # soak (every mode, KV pool 64k tokens) + faults, in the background
#   bash scripts/gpu/testbed.sh reliability-wait    # wait for them (RELIABILITY_WAIT s at most), fold reliability.json
#   bash scripts/gpu/testbed.sh reliability-stop    # stop them now (their own process groups)
#   bash scripts/gpu/testbed.sh turns    # bench.loopserve_turns: off, loopserve, loopserve engaged at 4096 tokens,
#                                        # 3 turns of 8k: TTFT per turn, lines reused from earlier turns (~4-5 min)
#   bash scripts/gpu/testbed.sh probeprof  # psa vs off on ~16k-token requests: TTFT, prefill + decode profiles
#                                          # (PROF_WORDS, PROF_CONC: prompt words, requests decoding together)
#   bash scripts/gpu/testbed.sh hostprof  # off and psa at 4k, concurrency 1 and 8: py-spy on each scheduler
#   bash scripts/gpu/testbed.sh realkern # kernel benches on attention captured from the 32k testbed model (issues
#                                        # 23/24): psa_decode.json real_16k/real_32k, loopserve_prefill.json
#                                        # real_32k, merged into copies of bench/results' headlines (~2-4 min)
#   bash scripts/gpu/testbed.sh kernwaves  # psa decode wave plans (planted) + the full psa kernel bench at the best one
#   bash scripts/gpu/testbed.sh kerncrit  # psa criticality launch shapes x metadata layouts (+ the GPU kernel tests)
#   bash scripts/gpu/testbed.sh samkvab-start  # samkv's plain-chat flips: off under samkv's server settings (overlap
#                                           # scheduler and prefill CUDA graphs off) soaked against off, in the background
#   bash scripts/gpu/testbed.sh samkvab-wait   # waits for it (RELIABILITY_WAIT seconds at most)
#   bash scripts/gpu/testbed.sh kernprofile  # psa decode stage times (criticality, ranking, suffix, waves) at the defaults
#   bash scripts/gpu/testbed.sh settings4k  # psa vs off at 4k under three server settings: which setting costs psa
#                                           # its fall-back throughput (page 16, prefill CUDA graphs off)
#   bash scripts/gpu/testbed.sh c1ab     # psa vs off at concurrency 1 (16k, 32k), off on page 1 and on page 16
#   bash scripts/gpu/testbed.sh ab4k     # psa / loopserve installed below min_context vs two off servers at 4k:
#                                        # bench.ab_rounds --pin-cpus --restart-each-round
#   bash scripts/gpu/testbed.sh lsfid    # loopserve ENGAGED (min_context $LS_MIN_CONTEXT, default 24576) against off on
#                                        # the `long` preset: the 32k bucket is the engaged one (~3-4 min); run it for any
#                                        # change to LoopServe's decode or selection (it is what a speed change can lose)
#   bash scripts/gpu/testbed.sh psafid   # psa ENGAGED (PSA_CONFIG; default the int4 key sketch, schedule select, from 8192 tokens) against
#                                        # off on the `long` preset, deterministic inference (~5 min)
#   bash scripts/gpu/testbed.sh psaspeed # psa (PSA_CONFIG) against plain SGLang end to end at 4k and 32k, concurrency 8/32
#   bash scripts/gpu/testbed.sh lsvarfid # loopserve configurations (LS_VARIANTS) on the `long` preset, deterministic,
#                                        # each against its own off, + bench.variants_report (~7 min)
#   bash scripts/gpu/testbed.sh lsvarspeed  # the same configurations end to end at 32k (bench.ab_rounds, ~5 min)
#   bash scripts/gpu/testbed.sh splitsweep  # the split-list decode's launch configs on the testbed's
#                                           # decode shapes, CUDA-graph replays (bench/sparse_decode_bench.py --sweep)
#   bash scripts/gpu/testbed.sh listblocks  # loopserve's decode-list kernels (lines_union, lines_append) by block width
#                                           # at 1 / 8 / 32 rows, CUDA-graph replays (bench/lines_union_bench.py)
#   bash scripts/gpu/testbed.sh lsspeed  # loopserve engaged against off at 32k: bench.load (concurrency 1/8/32) and
#                                        # bench.decode_profile (~24k tokens, concurrency 1) (~6 min)
#
# A part left running in the background while later calls poll it should run from a copy of the tree (cp the
# repository to /tmp and start it there): each call re-copies the working tree, and a process that imports a
# module during that copy can fail (Triton: '@jit functions should be defined in a Python file').
# TESTBED_TAG=x puts a part's reports in /tmp/testbed/<part>_x (two runs of a part side by side);
# LONG_EXTRA_ARGS / SAMKV_EXTRA_ARGS add server arguments to the `long` / `samkv` part's servers (e.g. --enable-deterministic-inference);
# HARNESS_ARGS adds arguments to its bench.run_harness (e.g. --sparse-config 'psa={"probe_steps":1}').
# SOAK_MODES picks the main soak's modes; SOAK_REPEAT_OFF=0 skips its second off run (the noise floor);
# SOAK_LABEL prefixes the run's label; RELIABILITY_BASE=bench/results/reliability.json folds the run into that
# headline (the modes soaked and the fault modes run replace its rows).
# SOAK_SERVER_ARGS: server arguments of every main soak server (default --enable-deterministic-inference: batch-invariant
# results, so a mode's wrong answers against off are its own and not batch noise); give reliability-wait the same variables.
# samkv refuses --enable-deterministic-inference on flashinfer, where SGLang turns the radix cache off, so the soak runs
# samkv in a second run of its own (off + samkv) under SAMKV_SOAK_ARGS (default: the triton backend with deterministic
# inference, which keeps the radix cache); its wrong answers are counted against that run's off. SAMKV_SOAK=0 skips it,
# SOAK_MAIN=0 runs it alone; RELIABILITY_FAULT_MODES="psa ..." limits the fault runs; FAULTS_MODE_TIMEOUT bounds each.
#
# Reports go to /tmp/testbed/<part>/ and come back packed as $OUT/<part>.tgz.
set -uo pipefail
part=${1:?usage: testbed.sh needle|long|samkv|samkvplain|samkvtests|e2e|turns|probeprof|hostprof|settings4k|c1ab|ab4k|lsfid|psafid|psaspeed|lsvarfid|lsvarspeed|psavarfid|psavarspeed|lsspeed|splitsweep|listblocks|realkern|kernwaves|kerncrit|kernprofile|samkvab-start|samkvab-wait|reliability-start|reliability-wait|reliability-stop}
out=${OUT:-$PWD/gpu_out}
name=${part%-*}${TESTBED_TAG:+_$TESTBED_TAG}
R=/tmp/testbed/$name
mkdir -p "$out" "$R"
# shellcheck disable=SC1091
source /tmp/kit/env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # this checkout, not the copy the kit installed
export PYTHONUNBUFFERED=1
M32=/tmp/models/SmolLM2-135M-Instruct-32k
M64=/tmp/models/SmolLM2-135M-Instruct-64k
SARGS="--attention-backend flashinfer"
MODES=${TESTBED_MODES:-off,psa,loopserve,lastwindow,samkv}
say() { echo "[testbed $(date +%H:%M:%S)] $*" | tee -a "$R/steps.txt"; }
step() {  # step NAME CMD...: logged; a failure is recorded, not fatal
  local name=$1; shift
  local t0; t0=$(date +%s)
  say "== $name"
  "$@" > "$R/$name.log" 2>&1
  local rc=$?
  say "== $name: exit $rc in $(( $(date +%s) - t0 ))s"
  tail -n 25 "$R/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$R/gpu.txt"
# the GPU server tests (pytest -m gpu) use models/SmolLM2-135M-Instruct: the kit's converted model
[ -e models/SmolLM2-135M-Instruct ] || { mkdir -p models && ln -sfn "$KIT_MODEL" models/SmolLM2-135M-Instruct; }
for ctx in 32768 65536; do  # the testbed folders: the kit's converted model + YaRN config (no download)
  m=/tmp/models/SmolLM2-135M-Instruct-$((ctx / 1024))k
  [ -f "$m/config.json" ] && continue  # built by an earlier part (servers of a background part may be reading it)
  python3 -m sglang_sparse.tools.build_model --context $ctx --base "$KIT_MODEL" --out "$m" >> "$R/steps.txt" 2>&1
done
# servers started beside other parts' servers on the same GPU: small KV pools, a pool check that tolerates them
SHARED="--mem-fraction-static=0.95"
# the soak's servers run batch-invariant by default, so a mode's wrong answers against off are its own (SOAK_SERVER_ARGS=""
# runs them without it; give reliability-wait the same variables as reliability-start, since it records them)
SOAK_SERVER_ARGS=${SOAK_SERVER_ARGS---enable-deterministic-inference}
repeat_off=--repeat-off; [ "${SOAK_REPEAT_OFF:-1}" = 1 ] || repeat_off=""   # reliability: the noise-floor off run
samkv_cmd=""; [ "${SAMKV_SOAK:-1}" = 1 ] && samkv_cmd="; then bench.soak --launch off,samkv with ${SAMKV_SOAK_ARGS:---attention-backend=triton --enable-deterministic-inference}"
case $part in
  needle)
    step needle32k timeout "${NEEDLE_TIMEOUT:-420}" python3 -m bench.run_harness --preset needle_table --modes off \
        --device cuda --python python3 --model $M32 --port 30000 --out "$R/needle32k" --concurrency 32 \
        --tasks-time-budget "${NEEDLE_TASK_BUDGET:-150}" --server-args "$SARGS"
    step needle32k_report python3 -m bench.report_long --needle-run "$R/needle32k" --needle-json "$R/needle_table.json"
    step needle64k timeout "${NEEDLE64_TIMEOUT:-170}" python3 -m bench.run_harness --preset needle_table_64k --modes off \
        --device cuda --python python3 --model $M64 --port 30000 --out "$R/needle64k" --concurrency 32 \
        --tasks-time-budget "${NEEDLE64_TASK_BUDGET:-70}" --server-args "$SARGS"
    step needle64k_report python3 -m bench.report_long --needle-run "$R/needle64k" --needle-json "$R/needle_table_64k.json"
    ;;
  long)
    step long timeout "${LONG_TIMEOUT:-560}" python3 -m bench.run_harness --preset long --modes "$MODES" --parallel \
        --concurrency "${LONG_CONCURRENCY:-16}" --tasks-time-budget "${LONG_TASK_BUDGET:-330}" --device cuda \
        --python python3 --model $M32 --port ${LONG_PORT:-30000} --out "$R/long" --server-args "$SARGS ${LONG_EXTRA_ARGS:-}" \
        ${HARNESS_ARGS:-}
    step long_report python3 -m bench.report_long --run "$R/long" --json "$R/fidelity_long.json" \
        --psa-json "$R/psa_fidelity.json" --loopserve-json "$R/loopserve_fidelity.json"
    ;;
  samkv)
    cp bench/results/samkv.json "$R/samkv.json" 2>/dev/null || true
    step samkv_rag timeout -k 20 "${SAMKV_TIMEOUT:-420}" python3 -m bench.samkv_rag --launch --device cuda \
        --python python3 --model $M32 --port 30020 --server-args "$SARGS ${SAMKV_EXTRA_ARGS:-}" --out "$R" --headline "$R/samkv.json" \
        --tasks "${SAMKV_TASKS:-20}" --time-budget "${SAMKV_TASK_BUDGET:-240}"
    ;;
  samkvplain)  # timing: run alone on the GPU. samkv's plain requests (no documents) against off end to end:
    # bench.load at 4k and 32k input, concurrency 1 / 8 / 32 (~6 min on a fresh machine)
    step samkvload timeout -k 20 "${SAMKVLOAD_TIMEOUT:-560}" python3 -m bench.load --device cuda --python python3 \
        --model $M32 --modes off,samkv --input-lens 4096,32000 --output-len 256 --concurrency 1,8,32 \
        --parallel-servers auto --port 30010 --time-budget "${SAMKVLOAD_BUDGET:-480}" --server-args "$SARGS" \
        --out "$R/load"
    ;;
  samkvtests)  # samkv's GPU server tests (tests/test_gpu_samkv_server.py, ~3-4 min on a fresh machine)
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    step samkv_gpu_tests timeout -k 20 "${GPU_TESTS_TIMEOUT:-300}" python3 -m pytest -m gpu -q -rs \
        tests/test_gpu_samkv_server.py
    ;;
  e2e)
    step e2e timeout -k 20 "${E2E_TIMEOUT:-560}" python3 -m bench.load --device cuda --python python3 --model $M32 \
        --modes "$MODES" --input-lens 4096,16384,32000 --output-len 256 --concurrency 1,8,32 --parallel-servers auto \
        --port 30010 --time-budget "${E2E_TASK_BUDGET:-450}" --server-args "$SARGS" --out "$R/e2e" ${E2E_ARGS:-}
    ;;
  turns)  # bench.loopserve_turns: 3 turns of 8k, TTFT per turn and lines reused across turns (timing: run alone)
    turns_default='off,loopserve,loopserve_engaged=loopserve:{"min_context": 4096}'
    step turns timeout -k 20 "${TURNS_TIMEOUT:-420}" python3 -m bench.loopserve_turns --launch --model $M32 \
        --device cuda --python python3 --configs "${TURNS_CONFIGS:-$turns_default}" --turns 3 --turn-tokens 8192 \
        --conversations "${TURNS_CONVERSATIONS:-6}" --port 30040 --server-args "$SARGS" --out "$R/turns"
    ;;
  probeprof)  # bench.decode_profile, off and psa: TTFT of ~16k-token requests (psa probes them at the end of
              # their prefill), SGLang's profile of one request's prefill and decode steps (timing: run alone);
              # PROF_SPARSE="MODE=JSON" configures the sparse mode (e.g. psa's select schedule from 8192 tokens)
    prof_cfg=(); [ -n "${PROF_SPARSE:-}" ] && prof_cfg=(--sparse-config "$PROF_SPARSE")
    step probeprof timeout -k 20 "${PROF_TIMEOUT:-420}" python3 -m bench.decode_profile --device cuda --python python3 \
        --model $M32 --modes "${PROF_MODES:-off,psa}" "${prof_cfg[@]}" --prompt-tokens "${PROF_WORDS:-12000}" --max-tokens 64 \
        --steps 32 --repeats "${PROF_REPEATS:-6}" --concurrency "${PROF_CONC:-1}" --port 30050 --server-args "$SARGS" \
        --out "$R/prof"
    ;;
  hostprof)  # bench.host_profile: py-spy on each server's scheduler during a cell (timing: run alone)
    spy=$(command -v py-spy || echo /tmp/spy/bin/py-spy)
    if [ ! -x "$spy" ]; then  # a py-spy wheel carried into the checkout (PY_SPY_WHEEL), installed off-line
      whl=${PY_SPY_WHEEL:-$(ls tmp_pyspy/py_spy-*.whl 2>/dev/null | head -1)}
      [ -n "$whl" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/spy "$whl" >> "$R/steps.txt" 2>&1
    fi
    step hostprof timeout -k 20 "${HP_TIMEOUT:-420}" python3 -m bench.host_profile --model $M32 --python python3 \
        --modes "${HP_MODES:-off,psa}" --input-len "${HP_LEN:-4096}" --concurrency "${HP_CONC:-1,8}" --prompts "${HP_PROMPTS:-16}" \
        --py-spy "$spy" --port 30060 --server-args "$SARGS" --out "$R/hp"
    ;;
  settings4k)  # timing: run alone on the GPU
    for cfg in "default:" "page16:--page-size 16" "page16_noprefillgraph:--page-size 16 --disable-prefill-cuda-graph" \
               "noprefillgraph:--disable-prefill-cuda-graph"; do
      tag=${cfg%%:*}
      step "ab_$tag" timeout -k 20 "${AB_TIMEOUT:-240}" python3 -m bench.load --device cuda --python python3 --model $M32 \
          --modes psa --input-lens 4096 --output-len 256 --concurrency 1,8,32 --parallel-servers 1 --port 30030 \
          --min-prompts 12 --prompts-per-concurrency 3 --time-budget "${AB_TASK_BUDGET:-200}" --server-args "$SARGS ${cfg#*:}" --out "$R/$tag"
    done
    python3 - "$R" <<'PY' | tee "$R/settings4k.md"
import json, sys, pathlib
root = pathlib.Path(sys.argv[1])
print("| server args (off and psa) | cell | off tok/s | psa tok/s | psa/off throughput | TTFT ratio | TPOT ratio |")
print("|---|---|---|---|---|---|---|")
for d in sorted(p for p in root.iterdir() if (p / "e2e_long.json").is_file()):
    e = json.loads((d / "e2e_long.json").read_text())
    off = (e.get("modes") or {}).get("off") or {}
    for cell, r in ((e.get("modes") or {}).get("psa") or {}).items():
        if not isinstance(r, dict) or "input_len" not in r:
            continue
        f = lambda x: "-" if x is None else f"{x:.3g}"
        print(f"| {d.name} | {cell} | {f((off.get(cell) or {}).get('output_throughput_tok_s'))} | "
              f"{f(r.get('output_throughput_tok_s'))} | {f(r.get('throughput_ratio_vs_off'))} | "
              f"{f(r.get('ttft_ratio_vs_off'))} | {f(r.get('tpot_ratio_vs_off'))} |")
PY
    ;;
  ab4k)  # timing: run alone on the GPU. The fall-back cost at 4k of psa and loopserve installed below their
          # min_context, against two off servers: fresh servers every round, each on its own cores (~7 min)
    step ab4k timeout -k 20 "${AB4K_TIMEOUT:-560}" python3 -m bench.ab_rounds --device cuda --python python3 --model $M32 \
        --servers 'off,off2=off,psa_live=psa:{"min_context":8192},loopserve_live=loopserve:{"min_context":8192}' \
        --input-len 4096 --output-len 256 --concurrency 1,8 --rounds "${AB4K_ROUNDS:-4}" --pin-cpus --restart-each-round \
        --port 30100 --server-args "$SARGS" --out "$R/ab4k"
    ;;
  lsfid)  # loopserve engaged on the `long` preset (fidelity of the engaged path; the 32k bucket engages at 24576)
    step lsfid timeout "${LONG_TIMEOUT:-420}" python3 -m bench.run_harness --preset long --modes off,loopserve --parallel \
        --concurrency 16 --tasks-time-budget "${LONG_TASK_BUDGET:-320}" --device cuda --python python3 --model $M32 \
        --port 30000 --out "$R/long" --server-args "$SARGS" \
        --sparse-config "loopserve={\"min_context\":${LS_MIN_CONTEXT:-24576}}"
    step lsfid_report python3 -m bench.report_long --run "$R/long" --json "$R/fidelity_engaged.json"
    ;;
  psafid)  # psa ENGAGED (PSA_CONFIG, default the int4 key sketch, schedule select, from 8192 tokens) against off on the `long` preset,
    # deterministic inference (two off runs agree on every turn), concurrency 16 (~5 min)
    step psafid timeout "${LONG_TIMEOUT:-420}" python3 -m bench.run_harness --preset long --modes off,psa --parallel \
        --concurrency 16 --tasks-time-budget "${LONG_TASK_BUDGET:-300}" --device cuda --python python3 --model $M32 \
        --port 30000 --out "$R/long" --server-args "$SARGS --enable-deterministic-inference" \
        --sparse-config "psa=${PSA_CONFIG:-{\"min_context\":8192,\"estimator\":\"sketch\",\"schedule\":\"select\"\}}"
    step psafid_report python3 -m bench.report_long --run "$R/long" --json "$R/fidelity_psa_engaged.json"
    ;;
  psaspeed)  # timing: run alone on the GPU. psa (PSA_CONFIG) against plain SGLang end to end: 4k (where it must fall
    # back) and 32k, concurrency 8 and 32 (~6 min; the time budget includes the servers' start, which compiles for
    # ~270 s on a fresh machine)
    step psaload timeout -k 20 "${PSALOAD_TIMEOUT:-600}" python3 -m bench.load --device cuda --python python3 --model $M32 \
        --modes stock,psa --sparse-config "psa=${PSA_CONFIG:-{\"min_context\":8192,\"estimator\":\"sketch\",\"schedule\":\"select\"\}}" \
        --input-lens "${PSALOAD_LENS:-4096,32000}" --output-len 256 --concurrency "${PSALOAD_CONC:-8,32}" \
        --parallel-servers auto --port 30010 --time-budget "${PSALOAD_BUDGET:-560}" --server-args "$SARGS" --out "$R/load"
    ;;
  lsvarfid|psavarfid)  # a mode's configurations side by side on the `long` preset, each against its own off,
    # deterministic inference (two off runs agree on every turn); then bench.variants_report (~7 min with two variants).
    # lsvarfid: loopserve, LS_VARIANTS="LABEL:JSON ..." (default: line_chunks auto / all, engaged from 8192 tokens).
    # psavarfid: psa, PSA_VARIANTS (default: the key sketch's select schedule at calib_slack 2 and 4, from 8192 tokens)
    vmode=loopserve
    variants=${LS_VARIANTS:-'auto:{"min_context":8192} all:{"min_context":8192,"line_chunks":"all"}'}
    if [ "$part" = psavarfid ]; then
      vmode=psa
      sel='"min_context":8192,"estimator":"sketch","schedule":"select"'
      variants=${PSA_VARIANTS:-"s2:{$sel} s4:{$sel,\"calib_slack\":4}"}
    fi
    i=0; fid_args=()
    for v in $variants; do
      tag=${v%%:*}
      timeout -k 20 "${LONG_TIMEOUT:-420}" python3 -m bench.run_harness --preset long --modes off,$vmode --parallel \
          --concurrency 16 --tasks-time-budget "${LONG_TASK_BUDGET:-260}" --device cuda --python python3 --model $M32 \
          --port $(( 30000 + 5000 * i )) --out "$R/fid_$tag" --server-args "$SARGS --enable-deterministic-inference" \
          --sparse-config "$vmode=${v#*:}" > "$R/fid_$tag.log" 2>&1 &
      fid_args+=(--fidelity "det:$tag=$R/fid_$tag")
      i=$(( i + 1 )); sleep 20  # the runs' servers do not start in the same second
    done
    wait
    step varfid_report python3 -m bench.variants_report --mode $vmode "${fid_args[@]}" --floor det \
        --out "$R/${vmode}_variants.json"
    ;;
  lsvarspeed|psavarspeed)  # timing: run alone on the GPU. The same configurations end to end at 32k against off
    # (bench.ab_rounds, servers side by side; LS_SPEED_VARIANTS / PSA_SPEED_VARIANTS="LABEL=MODE:JSON,..."), then
    # bench.variants_report
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    conc=1,8; mtt=270000; [ "${mem:-0}" -gt 120000 ] && { conc=1,8,32; mtt=1040000; }
    speed_default='ls_auto=loopserve:{"min_context":24576},ls_all=loopserve:{"min_context":24576,"line_chunks":"all"}'
    vmode=loopserve; servers=${LS_SPEED_VARIANTS:-$speed_default}
    if [ "$part" = psavarspeed ]; then
      vmode=psa; sel='"min_context":8192,"estimator":"sketch","schedule":"select"'
      servers=${PSA_SPEED_VARIANTS:-"s2=psa:{$sel},s4=psa:{$sel,\"calib_slack\":4}"}
    fi
    step varspeed timeout -k 20 "${AB_TIMEOUT:-540}" python3 -m bench.ab_rounds --device cuda --python python3 \
        --model $M32 --servers "off,$servers" \
        --input-len 32000 --output-len 256 --concurrency "$conc" --prompts-per-concurrency 2 --min-prompts 6 \
        --rounds "${AB_ROUNDS:-1}" --max-total-tokens $mtt --port 30100 --server-args "$SARGS" --out "$R/ab"
    step varspeed_report python3 -m bench.variants_report --mode $vmode --ab "$R/ab/ab_rounds.json" \
        --out "$R/${vmode}_variants_speed.json"
    ;;
  lsspeed)  # timing: run alone on the GPU. loopserve engaged against off at 32k, end to end and per decode step
    step lsload timeout -k 20 "${LSLOAD_TIMEOUT:-300}" python3 -m bench.load --device cuda --python python3 --model $M32 \
        --modes off,loopserve --sparse-config "loopserve={\"min_context\": ${LS_MIN_CONTEXT:-24576}}" \
        --input-lens 32000 --output-len 256 --concurrency 1,8,32 --parallel-servers auto --port 30010 \
        --time-budget 240 --server-args "$SARGS" --out "$R/load"
    step lsprof timeout -k 20 "${LSPROF_TIMEOUT:-250}" python3 -m bench.decode_profile --device cuda --python python3 \
        --model $M32 --modes off,loopserve --sparse-config 'loopserve={"min_context": 8192}' --prompt-tokens 18000 \
        --max-tokens 64 --steps 32 --repeats 2 --concurrency 1 --port 30050 --server-args "$SARGS" --out "$R/prof"
    rm -f "$R"/prof/*/*.trace.json*
    ;;
  c1ab)  # timing: run alone on the GPU. psa vs off at concurrency 1 (16k, 32k), off on stock page 1 and on psa's page 16
    for cfg in "page1:" "page16:--page-size 16"; do
      tag=${cfg%%:*}
      step "c1_$tag" timeout -k 20 "${C1_TIMEOUT:-170}" python3 -m bench.load --device cuda --python python3 --model $M32 \
          --modes psa --input-lens 16384,32000 --output-len 256 --concurrency 1 --min-prompts 16 --parallel-servers auto \
          --port 30040 --time-budget "${C1_TASK_BUDGET:-120}" --server-args "$SARGS ${cfg#*:}" --out "$R/$tag"
    done
    ;;
  realkern)  # --real-only: only the testbed-real rows run; they are merged into the seeded headline copies
    cp bench/results/psa_decode.json bench/results/loopserve_prefill.json "$R/"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1   # local model folder only (the device reaches nothing)
    step psa_real timeout -k 20 "${REALKERN_TIMEOUT:-240}" python3 bench/psa_decode_bench.py --real-only \
        --testbed-model $M32 --out "$R" --real-estimators "${REALKERN_ESTIMATORS:-select,sketch,calibrated}"
    step loopserve_real timeout -k 20 "${REALKERN_TIMEOUT:-240}" python3 bench/loopserve_prefill_bench.py --real-only \
        --testbed-model $M32 --out "$R"
    ;;
  splitsweep)  # timing: run alone on the GPU. loopserve's split-list decode per layer: tile / warps / stages at the
    # runner's graph plans for 1 / 8 / 32 rows and the deterministic one-row plan
    step splitsweep timeout -k 20 "${SPLIT_TIMEOUT:-300}" python3 bench/sparse_decode_bench.py --sweep --out "$R"
    ;;
  listblocks)  # timing: run alone on the GPU. lines_union / lines_append by block width (the lists are checked equal)
    step listblocks timeout -k 20 "${LISTBLOCKS_TIMEOUT:-200}" python3 bench/lines_union_bench.py --out "$R"
    ;;
  kernwaves)  # psa decode wave plans on the planted cases, then the full kernel bench (planted grid + testbed real
    # rows) at the plan picked from the sweep (bench/psa_decode_bench.py pick_wave_plan), ~5-6 minutes
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    [ "${KERNWAVES_SWEEP:-1}" = 1 ] && step psa_waves timeout -k 20 "${WAVES_TIMEOUT:-300}" python3 bench/psa_decode_bench.py \
        --wave-sweep --testbed-model $M32 --out "$R"
    [ "${KERNWAVES_FULL:-1}" = 1 ] && step psa_full timeout -k 20 "${KERNEL_TIMEOUT:-330}" python3 bench/psa_decode_bench.py \
        --wave-plan "best:$R/psa_wave_sweep.json" --testbed-model $M32 --out "$R"
    rm -f "$R"/*.png
    ;;
  kerncrit)  # the psa kernel's GPU tests (every swept launch shape and layout against the reference), then the
    # criticality pass over launch shapes x metadata layouts (bench/psa_decode_bench.py --crit-sweep), ~5 minutes
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    step psa_gpu_tests timeout -k 20 "${GPU_TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu -q -x tests/flashinfer_ext/test_gpu_psa.py
    step psa_crit timeout -k 20 "${CRIT_TIMEOUT:-330}" python3 bench/psa_decode_bench.py --crit-sweep \
        --testbed-model $M32 --out "$R"
    ;;
  kernprofile)  # where a psa decode layer's time goes at the defaults (criticality, ranking, bound suffix, waves +
    # merges): the planted headline cases and the 32k testbed capture, ~1 minute
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    step psa_stages timeout -k 20 "${PROFILE_TIMEOUT:-240}" python3 bench/psa_decode_bench.py --stage-profile \
        --testbed-model $M32 --out "$R"
    ;;
  samkvab-start)  # samkv's chat flips: is it samkv, or the server settings samkv needs? (1) off and samkv, (2) off
    # with samkv's settings (overlap scheduler and prefill CUDA graphs off) against run 1's off; the same workload
    settings="--server-arg=--attention-backend=triton --server-arg=--enable-deterministic-inference"
    soak_common="--model $M32 --requests ${SOAK_REQUESTS:-5000} --time-budget ${SOAK_MODE_BUDGET:-100} --concurrency 4 \
          --turn-words ${SOAK_TURN_WORDS:-7000} --max-tokens 16 --sample-every 10 --log-dir $R \
          --server-arg=$SHARED --server-arg=--max-total-tokens=65536 $settings"
    ( setsid bash -c "
        timeout -k 20 ${SOAK_TIMEOUT:-900} python3 -m bench.soak --launch off,samkv $soak_common \
          --out $R/soak_samkv.json > $R/soak_samkv.log 2>&1
        timeout -k 20 ${SOAK_TIMEOUT:-900} python3 -m bench.soak --launch off $soak_common \
          --server-arg=--disable-overlap-schedule --server-arg=--disable-prefill-cuda-graph \
          --reference-json $R/soak_samkv.json --out $R/soak_off_settings.json > $R/soak_off_settings.log 2>&1
        echo \$? > $R/samkvab.rc" > /dev/null 2>&1 < /dev/null & )
    sleep 2
    exit 0
    ;;
  samkvab-wait)
    t0=$(date +%s)
    while [ ! -f "$R/samkvab.rc" ] && [ $(( $(date +%s) - t0 )) -lt "${RELIABILITY_WAIT:-400}" ]; do sleep 5; done
    say "== samkvab-wait: rc $(cat "$R/samkvab.rc" 2>/dev/null || echo running)"
    tail -n 8 "$R/soak_samkv.log" "$R/soak_off_settings.log" 2>/dev/null
    part=samkvab
    ;;
  reliability-start)  # no timing figure comes from these: they may share the GPU with the `long` part
    say "== reliability: soak + faults started in the background"
    : > "$R/background.pgids"   # this start's process groups only (reliability-stop signals them)
    soak_extra=""; for x in ${SOAK_SERVER_ARGS:-}; do soak_extra="$soak_extra --server-arg=$x"; done
    samkv_extra=""; for x in ${SAMKV_SOAK_ARGS:---attention-backend=triton --enable-deterministic-inference}; do
      samkv_extra="$samkv_extra --server-arg=$x"; done
    soak_common="--model $M32 --requests ${SOAK_REQUESTS:-5000} --time-budget ${SOAK_MODE_BUDGET:-125} --concurrency 4 \
          --turn-words ${SOAK_TURN_WORDS:-7000} --max-tokens 16 --sample-every 10 --log-dir $R \
          --server-arg=$SHARED --server-arg=--max-total-tokens=65536"
    [ "${SAMKV_SOAK:-1}" = 1 ] || echo skipped > "$R/soak_samkv.rc"
    [ "${SOAK_MAIN:-1}" = 1 ] || echo skipped > "$R/soak.rc"   # SOAK_MAIN=0: only the samkv run (and faults)
    ( setsid bash -c "
        if [ '${SOAK_MAIN:-1}' = 1 ]; then
          timeout -k 20 ${SOAK_TIMEOUT:-1500} python3 -m bench.soak --launch ${SOAK_MODES:-off,psa,loopserve,lastwindow} \
            $soak_common $repeat_off --server-arg=--attention-backend=flashinfer \
            $soak_extra --out $R/soak.json > $R/soak.log 2>&1
          echo \$? > $R/soak.rc
        fi
        if [ '${SAMKV_SOAK:-1}' = 1 ]; then
          timeout -k 20 ${SOAK_TIMEOUT:-1500} python3 -m bench.soak --launch off,samkv $soak_common $samkv_extra \
            --out $R/soak_samkv.json > $R/soak_samkv.log 2>&1
          echo \$? > $R/soak_samkv.rc
        fi" > /dev/null 2>&1 < /dev/null & echo $! >> "$R/background.pgids" )
    [ "${RELIABILITY_FAULTS:-1}" = 1 ] || echo done > "$R/faults.rc"   # soak only
    [ "${RELIABILITY_FAULTS:-1}" = 1 ] && ( setsid bash -c "
        for m in ${RELIABILITY_FAULT_MODES:-psa loopserve samkv lastwindow,off}; do
          timeout -k 20 ${FAULTS_MODE_TIMEOUT:-420} python3 -m bench.faults --modes \$m --model $KIT_MODEL \
            --server-arg=$SHARED --log-dir $R --out $R/faults_\${m%,*}.json >> $R/faults.log 2>&1
          echo \"\$m \$?\" >> $R/faults.rc
        done
        echo done >> $R/faults.rc" > /dev/null 2>&1 < /dev/null & echo $! >> "$R/background.pgids" )
    sleep 2
    exit 0
    ;;
  reliability-stop)  # stop what reliability-start left running: its process groups only (background.pgids)
    while read -r g; do
      [ -n "$g" ] && [ "$g" -gt 1 ] && kill -TERM -- "-$g" 2>/dev/null && say "== reliability-stop: TERM to group $g"
    done < "$R/background.pgids" 2>/dev/null
    sleep 15
    while read -r g; do
      [ -n "$g" ] && [ "$g" -gt 1 ] && kill -KILL -- "-$g" 2>/dev/null && say "== reliability-stop: KILL to group $g"
    done < "$R/background.pgids" 2>/dev/null
    exit 0
    ;;
  reliability-wait)
    t0=$(date +%s)
    while { [ ! -f "$R/soak.rc" ] || [ ! -f "$R/soak_samkv.rc" ] || ! grep -q done "$R/faults.rc" 2>/dev/null; } \
        && [ $(( $(date +%s) - t0 )) -lt "${RELIABILITY_WAIT:-400}" ]; do sleep 5; done
    say "== reliability-wait: soak rc $(cat "$R/soak.rc" 2>/dev/null || echo running), samkv soak rc $(cat "$R/soak_samkv.rc" 2>/dev/null || echo running), faults $(tr '\n' ' ' < "$R/faults.rc" 2>/dev/null)"
    tail -n 30 "$R/soak.log" "$R/faults.log" 2>/dev/null
    [ -f "$R/soak_samkv.log" ] && tail -n 15 "$R/soak_samkv.log"
    knobs=""  # the settings this run was given, so the recorded command says what ran
    for v in SOAK_MODES SOAK_REPEAT_OFF SAMKV_SOAK SOAK_MAIN RELIABILITY_FAULTS RELIABILITY_FAULT_MODES SOAK_SERVER_ARGS \
        SAMKV_SOAK_ARGS SOAK_MODE_BUDGET SOAK_TURN_WORDS SOAK_REQUESTS RELIABILITY_BASE; do
      [ -n "${!v:-}" ] && knobs="$knobs $v=${!v}"
    done
    main_cmd="bench.soak --launch ${SOAK_MODES:-off,psa,loopserve,lastwindow} $repeat_off --attention-backend flashinfer${SOAK_SERVER_ARGS:+ $SOAK_SERVER_ARGS}"
    [ "${SOAK_MAIN:-1}" = 1 ] || main_cmd="no main soak"
    faults_cmd="bench.faults for ${RELIABILITY_FAULT_MODES:-psa loopserve samkv lastwindow,off} on the 8k model"
    [ "${RELIABILITY_FAULTS:-1}" = 1 ] || faults_cmd="no fault runs (the faults are kept from the base)"
    soaks=()  # the soak reports this run wrote (SOAK_MAIN=0: the samkv run alone)
    [ -f "$R/soak.json" ] && soaks+=(--soak "$R/soak.json=${SOAK_LABEL:+$SOAK_LABEL: }--attention-backend=flashinfer${SOAK_SERVER_ARGS:+ $SOAK_SERVER_ARGS}")
    base=(); [ -n "${RELIABILITY_BASE:-}" ] && base=(--base "$RELIABILITY_BASE")
    [ -f "$R/soak_samkv.json" ] && soaks+=(--soak "$R/soak_samkv.json=${SAMKV_SOAK_ARGS:---attention-backend=triton --enable-deterministic-inference}")
    [ "${#soaks[@]}" -gt 0 ] && python3 -m bench.reliability "${soaks[@]}" "${base[@]}" --faults "$R"/faults_*.json \
        --gpu "$(cut -d, -f1 "$R/gpu.txt")" --out "$R/reliability.json" --md "$R/reliability.md" \
        --command "scripts/gpu/testbed.sh reliability-start${knobs:+ with$knobs}: $main_cmd on the 32k testbed, --max-total-tokens 65536, --time-budget ${SOAK_MODE_BUDGET:-125} s per mode$samkv_cmd; $faults_cmd"
    rm -f "$R"/*.pt 2>/dev/null
    part=reliability
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
[ "${SAVE_CACHE:-0}" = 1 ] && bash /tmp/kit/device.sh save-cache >> "$R/steps.txt" 2>&1
tar czf "$out/$name.tgz" -C /tmp/testbed "$name"
ls -la "$out"
