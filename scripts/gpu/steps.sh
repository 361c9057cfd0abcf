# Sourced by scripts/gpu/part_*.sh: `say` and `step` for a GPU part that reports into "$rep".
# Needs: rep (report folder), part (name in the log lines); sets rc=1 when a step fails.
rc=${rc:-0}
say() { echo "[$part $(date +%H:%M:%S)] $*"; }
step() {  # step NAME CMD...: its log in the report folder; a failure is recorded, not fatal
  local name=$1; shift
  say "== $name"
  local t0=$(date +%s)
  "$@" > "$rep/$name.log" 2>&1
  local src=$?
  tail -n 25 "$rep/$name.log"
  echo "$name exit=$src seconds=$(( $(date +%s) - t0 ))" | tee -a "$rep/steps.txt"
  [ "$src" = 0 ] || rc=1
}
