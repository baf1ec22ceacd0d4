#!/usr/bin/env bash
# `make demo-review`: the paper-review task on CPU with the `smol` recipe (SmolLM2-135M-Instruct in
# 4-bit NF4): 01 (every paper and review of the bundled file) -> 02 (SFT on the windows of a few
# papers) -> 04_train_dpo (DPO, rejected reviews written by the SFT model) -> 05 (held-out papers:
# ratings against the reviewers, both baselines, BLEU-4/ROUGE). Prints the eval report's path.
source "$(dirname "$0")/demo_lib.sh"

pairs=$(stage 01_build_pairs.py --config configs/smol/review/01_build_pairs.yaml)
sft=$(stage 02_train_sft.py --config configs/smol/review/02_train_sft.yaml --pairs_run "$pairs")
dpo=$(stage 04_train_dpo.py --config configs/smol/review/04_train_dpo.yaml --sft_run "$sft")
evalrun=$(stage 05_eval.py --config configs/smol/review/05_eval.yaml --pairs_run "$pairs" --sft_run "$sft" \
  --policy_runs "$dpo")

echo
echo "review demo finished in $(( $(date +%s) - start )) s; runs: $pairs $sft $dpo $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
