# Sourced by the demo scripts: the repository root, offline settings, and `stage`, which runs one
# stage script with the demo's runs directory (unless it is given one), echoes its log to stderr and
# prints its run directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
RUNS_DIR=${RUNS_DIR:-runs}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

stage() {
  local out arg runs=(--runs_dir "$RUNS_DIR")
  for arg in "$@"; do  # a caller's own --runs_dir is kept (a field given twice is refused)
    [[ $arg == --runs_dir || $arg == --runs_dir=* ]] && runs=()
  done
  # >(cat >&2), not /dev/stderr: reopening /dev/stderr when it is a file starts writing at the
  # file's beginning, so each stage would overwrite the log of the ones before it
  out=$("$PY" "$@" "${runs[@]}" | tee >(cat >&2)) || exit 1
  grep '^run_dir: ' <<<"$out" | tail -1 | cut -d' ' -f2-
}

# `background NAME SCRIPT ARGS...` runs a stage in the background, its output in $LOGS/NAME.log and,
# once it has finished, its run directory in $LOGS/NAME.dir; `wait_for_all` waits for every one and
# stops the script, showing the log's end, when one failed (`wait_for_all --allow_failures` only
# names them).
background() {
  local name=$1; shift
  rm -f "$LOGS/$name.dir"
  ( "$PY" "$@" --runs_dir "$RUNS_DIR" > "$LOGS/$name.log" 2>&1 \
    && grep '^run_dir: ' "$LOGS/$name.log" | tail -1 | cut -d' ' -f2- > "$LOGS/$name.dir" ) &
  BACKGROUND+=("$name")
}
BACKGROUND=()

wait_for_all() {
  wait
  local name failed=0
  for name in "${BACKGROUND[@]}"; do
    if [[ ! -s "$LOGS/$name.dir" ]]; then
      echo "stage $name failed; the end of $LOGS/$name.log:" >&2
      tail -5 "$LOGS/$name.log" >&2
      failed=1
    fi
  done
  BACKGROUND=()
  [[ $failed == 0 || ${1:-} == --allow_failures ]] || exit 1
}
