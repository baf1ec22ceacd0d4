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
