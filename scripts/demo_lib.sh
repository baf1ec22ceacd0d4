# Sourced by the demo scripts: the repository root, offline settings, and `stage`, which runs one
# stage script with the demo's runs directory, echoes its log to stderr and prints its run directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-.venv/bin/python}
RUNS_DIR=${RUNS_DIR:-runs}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

stage() {
  local out
  out=$("$PY" "$@" --runs_dir "$RUNS_DIR" | tee /dev/stderr) || exit 1
  grep '^run_dir: ' <<<"$out" | tail -1 | cut -d' ' -f2-
}
