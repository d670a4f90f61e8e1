# Shared by bench/gpu_check.sh and bench/npu_check.sh (sourced, not run): stages with time
# budgets, each writing its results into $OUT the moment it ends, and a --dry-run that lists the
# stages and checks on any machine that every stage's Python entry imports and parses its arguments.
#
# The sourcing script sets DEVICE (cuda / npu), KIND (a word for the log), STAGE_ORDER (the
# stages in order of value), BUDGET (associative array: stage -> seconds), TOTAL_BUDGET, and
# defines stage_<name> (the real run) and dry_<name> (the dry-run check) for every stage.

set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown argument $arg (use --dry-run or --help)" >&2; exit 2 ;;
  esac
done
STAGES=${STAGES:-${STAGE_ORDER[*]}}
status=0
started=$(date +%s)

want() { [[ " $STAGES " == *" $1 "* ]]; }
log() { echo "$*" | tee -a "${LOG:-/dev/null}"; }

# The stage's timeout: its budget, cut to what is left of TOTAL_BUDGET.
stage_timeout() {
  local left=$(( TOTAL_BUDGET - ($(date +%s) - started) ))
  local budget=${BUDGET[$1]}
  (( left < budget )) && budget=$left
  (( budget < 1 )) && budget=1
  echo "$budget"
}

record() {  # stage, exit status, seconds: one line of stages.tsv, written when the stage ends
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${BUDGET[$1]}" >>"$OUT/stages.tsv"
}

run_stage() {
  local name=$1 t0 rc limit
  limit=$(stage_timeout "$name")
  log "=== $name (budget ${BUDGET[$name]} s, timeout $limit s, $(date +%T))"
  t0=$(date +%s)
  LIMIT=$limit "stage_$name"
  rc=$?
  record "$name" "$rc" "$(( $(date +%s) - t0 ))"
  if (( rc != 0 )); then
    log "!!! stage $name failed (exit $rc$( (( rc == 124 )) && echo ', timed out'))"
    status=1
  fi
}

# Python entries that every stage runs, with the arguments it gives them, checked with --dry-run.
dry_entry() {  # description, command...
  local what=$1; shift
  if "$@" >/tmp/samepath-dry.$$ 2>&1; then
    echo "  ok   $what: $(tail -1 /tmp/samepath-dry.$$)"
  else
    echo "  FAIL $what: $*"
    sed 's/^/       /' /tmp/samepath-dry.$$
    status=1
  fi
  rm -f /tmp/samepath-dry.$$
}

main() {
  if (( DRY )); then
    echo "$KIND device check, dry run: stages in order, time budgets (whole run <= $TOTAL_BUDGET s)"
    local sum=0 name
    for name in "${STAGE_ORDER[@]}"; do
      want "$name" || continue
      printf '  stage %-8s budget %4d s  %s\n' "$name" "${BUDGET[$name]}" "${ABOUT[$name]}"
      sum=$(( sum + BUDGET[$name] ))
    done
    echo "  total budget $sum s"
    (( sum <= TOTAL_BUDGET )) || { echo "  FAIL budgets add up to more than $TOTAL_BUDGET s"; status=1; }
    echo "Python entries (each must import and parse its arguments here, no $KIND needed):"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    OUT=${OUT:-/tmp/samepath-dry-out}
    for name in "${STAGE_ORDER[@]}"; do
      want "$name" && "dry_$name"
    done
    echo "dry run: status $status"
    exit $status
  fi
  OUT=${OUT:-bench/results/$DEVICE-$(date +%Y%m%d-%H%M%S)}
  mkdir -p "$OUT"
  LOG="$OUT/check.log"
  : >"$OUT/stages.tsv"
  log "$KIND device check: stages $STAGES into $OUT ($(date -u +%FT%TZ))"
  local name
  for name in "${STAGE_ORDER[@]}"; do
    want "$name" && run_stage "$name"
  done
  log "=== done (status $status, $(( $(date +%s) - started )) s)"
  ls -la "$OUT" | tee -a "$LOG"
  exit $status
}

# Optional wheels (Liger-Kernel, FlashInfer, ...) carried in .whl/: installed without network or
# dependencies into /tmp/site, never replacing the machine's torch / triton / transformers.
install_wheels() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  if (( ${#wheels[@]} == 0 )); then
    log "no .whl/*.whl carried: optional baselines that the machine lacks are listed as not importable"
    return 0
  fi
  log "installing ${#wheels[@]} carried wheel(s) into /tmp/site: ${wheels[*]}"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
    >>"$LOG" 2>&1 || { log "wheel install failed (see log)"; return 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# samepath from this checkout, leaving the machine's packages alone (works offline); the editable
# install registers the vLLM plugin's entry point, PYTHONPATH is the fallback.
install_samepath() {
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
    log "pip install --no-deps --no-build-isolation -e . failed: samepath comes from PYTHONPATH (no vLLM entry point)"
  fi
}
