# Sourced by the demo scripts: the repository root, offline settings, and `stage`, which runs one
# stage script with the demo's runs directory (unless it is given one), echoes its log to stderr and
# prints its run directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
RUNS_DIR=${RUNS_DIR:-runs}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

# `timeline NAME START STATUS`: one line a finished stage in $LOGS/timeline.tsv (name, start and end in epoch
# seconds, exit status), so that a chain says where its time went; nothing without LOGS.
timeline() {
  [[ -n ${LOGS:-} ]] || return 0
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$(date +%s)" "$3" >> "$LOGS/timeline.tsv"
}

stage() {
  local out arg runs=(--runs_dir "$RUNS_DIR")
  for arg in "$@"; do  # a caller's own --runs_dir is kept (a field given twice is refused)
    [[ $arg == --runs_dir || $arg == --runs_dir=* ]] && runs=()
  done
  # The stage's stdout (its run_dir line) is echoed to stderr once it has ended: a `tee >(cat >&2)` could
  # still be writing when the chain exits, and its last stage's lines were lost (its logging goes to stderr
  # as it runs).
  local t0 rc=0; t0=$(date +%s)
  out=$("$PY" "$@" "${runs[@]}") || rc=$?
  [[ -z $out ]] || printf '%s\n' "$out" >&2
  (( rc == 0 )) || { timeline "$1" "$t0" 1; echo "error: stage $1 failed; the chain stops" >&2; exit 1; }
  timeline "$1" "$t0" 0
  grep '^run_dir: ' <<<"$out" | tail -1 | cut -d' ' -f2-
}

# `background NAME SCRIPT ARGS...` runs a stage in the background, its output in $LOGS/NAME.log and,
# once it has finished, its run directory in $LOGS/NAME.dir; `wait_for_all` waits for every one and
# stops the script, showing the log's end, when one failed. `wait_for_all --allow_failures` goes on,
# naming them: a stage its length guard stopped is a finding (STOPPED), any other failure is kept in
# FAILED, and `finish_chain` (the chain's last step) then ends the chain with status 1, naming them.
# `background NAME --after DEP SCRIPT ARGS...` starts once the background stage DEP has finished, every
# `@DEP` of ARGS replaced by DEP's run directory, so that it waits for that stage alone, not for all; it
# fails, saying why, when DEP did. MAX_JOBS: at most that many of a script's stages at once (the rest
# wait their turn), so that a chain fits one GPU's memory. RESUME=1 restarts a chain that stopped: a
# stage whose --run_name already names a finished run (DONE) is not run again, its run is taken as it is;
# an unfinished one is left as it is and the stage runs again under the next free name (NAME_2, ...).
background() {
  local name=$1 after=""; shift
  ARGS_OF[$name]=$(printf '%q ' "$@")  # to run it again (wait_for_all, after running out of GPU memory)
  [[ ${1:-} == --after ]] && { after=$2; shift 2; }
  rm -f "$LOGS/$name.dir" "$LOGS/$name.finished"
  local args=("$@") i run next n
  for (( i = 0; i < ${#args[@]} - 1; i++ )); do
    [[ ${args[i]} == --run_name && ${RESUME:-0} == 1 ]] || continue
    run=${args[i + 1]}
    if [[ -f "$RUNS_DIR/$run/DONE" ]]; then
      echo "stage $name: $RUNS_DIR/$run is finished, taken as it is (RESUME=1)" >&2
      echo "$RUNS_DIR/$run" > "$LOGS/$name.dir"
      touch "$LOGS/$name.finished"
      return
    fi
    next=$run n=1
    while [[ -e "$RUNS_DIR/$next" ]]; do n=$((n + 1)); next=${run}_$n; done
    args[i + 1]=$next
  done
  while (( $(jobs -rp | wc -l) >= ${MAX_JOBS:-1000} )); do wait -n || true; done
  ( local t0 rc=0
    if [[ -n $after ]]; then
      until [[ -e "$LOGS/$after.finished" ]]; do sleep 1; done
      if [[ -s "$LOGS/$after.dir" ]]; then
        for i in "${!args[@]}"; do [[ ${args[i]} == "@$after" ]] && args[i]=$(cat "$LOGS/$after.dir"); done
      else
        echo "error: stage $after, whose run this stage reads, did not finish ($LOGS/$after.log)" > "$LOGS/$name.log"
        rc=1
      fi
    fi
    t0=$(date +%s)
    if (( ! rc )); then  # in the background of this subshell, so that stop_background's TERM reaches the stage
      "$PY" "${args[@]}" --runs_dir "$RUNS_DIR" > "$LOGS/$name.log" 2>&1 &
      trap 'kill $! 2>/dev/null; exit 143' TERM
      wait $! || rc=$?
    fi
    (( rc )) || grep '^run_dir: ' "$LOGS/$name.log" | tail -1 | cut -d' ' -f2- > "$LOGS/$name.dir"
    timeline "$name" "$t0" "$rc"
    touch "$LOGS/$name.finished" ) &
  BACKGROUND+=("$name")
}
BACKGROUND=() FAILED=() STOPPED=()
declare -A ARGS_OF=() RETRIED=()

# `gpu_jobs GIB`: how many stages of GIB GiB each the GPU's free memory holds (at least 1; 8 without nvidia-smi), a
# chain's default MAX_JOBS. Free, not total: another job on the card (a test suite, a second chain) keeps its share.
gpu_jobs() {
  local mib
  mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -1 || true)
  echo $(( ${mib:-0} >= $1 * 1024 ? ${mib:-0} / ($1 * 1024) : (${mib:-0} > 0 ? 1 : 8) ))
}

# A chain that stops on an error (a stage in the foreground failed) takes its background stages with it: left
# running they would hold the GPU and write runs after the chain has said it failed.
stop_background() {
  local pid
  for pid in $(jobs -p); do kill "$pid" 2>/dev/null; done
  return 0
}
trap 'rc=$?; (( rc == 0 )) || stop_background' EXIT

# A stage that ran out of GPU memory beside others (a card smaller than the chain's MAX_JOBS was sized for)
# runs again once, alone, under the next free run name, and so does a stage that waited on it (--after);
# the second failure is a failure.
wait_for_all() {
  wait
  local name dep failed=0 retry=() ran=("${BACKGROUND[@]}")
  BACKGROUND=()
  for name in "${ran[@]}"; do
    [[ -s "$LOGS/$name.dir" ]] && continue
    if grep -q '^error: reward-hacking guard' "$LOGS/$name.log" 2>/dev/null; then
      echo "stage $name was stopped by its length guard (a finding, not a failure): $LOGS/$name.log" >&2
      STOPPED+=("$name")
      continue
    fi
    dep=$(sed -n 's/^error: stage \([^ ,]*\), whose run this stage reads, did not finish.*/\1/p' "$LOGS/$name.log" 2>/dev/null)
    if (( ${#ran[@]} > 1 && ${MAX_JOBS:-1000} > 1 )) && [[ -z ${RETRIED[$name]:-} ]] && { grep -q 'CUDA out of memory' "$LOGS/$name.log" \
         2>/dev/null || [[ -n $dep && " ${retry[*]} " == *" $dep "* ]]; }; then
      retry+=("$name")
      continue
    fi
    echo "stage $name failed; the end of $LOGS/$name.log:" >&2
    tail -5 "$LOGS/$name.log" >&2
    FAILED+=("$name")
    failed=1
  done
  [[ $failed == 0 || ${1:-} == --allow_failures ]] || { echo "error: stage(s) failed: ${FAILED[*]}" >&2; exit 1; }
  (( ${#retry[@]} )) || return 0
  echo "stage(s) ${retry[*]} ran out of GPU memory beside other stages (or waited on one that did): each runs" \
    "again, alone" >&2
  local MAX_JOBS=1 RESUME=1  # RESUME: the unfinished run is kept, the stage writes the next free name
  for name in "${retry[@]}"; do RETRIED[$name]=1; eval "background $name ${ARGS_OF[$name]}"; done
  wait_for_all "$@"
}

# `finish_chain WHAT [DETAILS]`: the chain's closing line. Status 1, naming every failed stage and its log, when a
# stage failed along the way; else WHAT finished, with the stages a guard stopped named.
finish_chain() {
  local name
  if (( ${#FAILED[@]} )); then
    echo "error: $1 did not finish: ${#FAILED[@]} stage(s) failed:" \
      "$(for name in "${FAILED[@]}"; do printf '%s (%s) ' "$name" "$LOGS/$name.log"; done)" >&2
    exit 1
  fi
  echo "$1 finished in $(( $(date +%s) - start )) s${2:+; $2}${STOPPED[*]:+; stopped by their length guard: ${STOPPED[*]}}"
}
