#!/usr/bin/env bash
# `make demo`: the five stages on a slice of the bundled ChangeMyView data, with the `smol` recipe
# (SmolLM2-135M-Instruct in 4-bit NF4) on the CPU. Prints the path of the eval report at the end.
source "$(dirname "$0")/demo_lib.sh"

pairs=$(stage 01_build_pairs.py --config configs/smol/01_build_pairs.yaml)
sft=$(stage 02_train_sft.py --config configs/smol/02_train_sft.yaml --pairs_run "$pairs")
reward=$(stage 03_train_reward.py --config configs/smol/03_train_reward.yaml --pairs_run "$pairs")
# A second judge that GRPO never trains against, on posts the policy never sees (the dev split).
heldout=$(stage 03_train_reward.py --config configs/smol/03_train_reward_heldout.yaml --pairs_run "$pairs")
grpo=$(stage 04_train_grpo.py --config configs/smol/04_train_grpo.yaml --sft_run "$sft" --reward_run "$reward")
evalrun=$(stage 05_eval.py --config configs/smol/05_eval.yaml --pairs_run "$pairs" --reward_run "$reward" \
  --judge_runs "$heldout" --sft_run "$sft" --policy_runs "$grpo")

echo
echo "demo finished in $(( $(date +%s) - start )) s; runs: $pairs $sft $reward $heldout $grpo $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
