#!/usr/bin/env bash
# `make demo`: the five stages on a slice of the bundled ChangeMyView data, with the `smol` recipe
# (SmolLM2-135M-Instruct in 4-bit NF4) on the CPU. Prints the path of the eval report at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RUNS_DIR=${RUNS_DIR:-runs}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

stage() {  # run one stage, echo its log to stderr, return its run directory
  local out
  out=$("$PY" "$@" --runs_dir "$RUNS_DIR" | tee /dev/stderr) || exit 1
  grep '^run_dir: ' <<<"$out" | tail -1 | cut -d' ' -f2-
}

pairs=$(stage 01_build_pairs.py --config configs/smol/01_build_pairs.yaml)
sft=$(stage 02_train_sft.py --config configs/smol/02_train_sft.yaml --pairs_run "$pairs")
reward=$(stage 03_train_reward.py --config configs/smol/03_train_reward.yaml --pairs_run "$pairs")
grpo=$(stage 04_train_grpo.py --config configs/smol/04_train_grpo.yaml --sft_run "$sft" --reward_run "$reward")
evalrun=$(stage 05_eval.py --config configs/smol/05_eval.yaml --pairs_run "$pairs" --reward_run "$reward" \
  --sft_run "$sft" --policy_runs "$grpo")

echo
echo "demo finished in $(( $(date +%s) - start )) s; runs: $pairs $sft $reward $grpo $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
