#!/usr/bin/env bash
# Persuasion on real weights, end to end (docs/results.md, "Real weights: persuasion"):
#   01 (split by period: test = the later posts) -> 02 (SFT on the winners)
#   -> 03 the training judge (SmolLM2, pairwise, train posts) and the held-out judge (the same, dev posts)
#   -> 04 GRPO against the training judge; DPO and ORPO on the same pairs
#   -> 05 on the test premises: base, SFT, GRPO, DPO, ORPO under both judges
#   -> the summary (scripts/persuasion_real_weights.py): per model and judge, reward, win rate and
#      length-controlled win rate vs SFT and vs base with intervals, reply length, distinct-2; the
#      held-out judge's accuracy on the test pairs beside length-only and bag-of-words.
# RECIPE: the recipe folder (default configs/smol-gpu; the test runs configs/tiny); JUDGE (default
# 03_train_reward_smol.yaml: the recipe's judge config for both judges, e.g. 03_train_reward_minilm.yaml); PAIRS_CONFIG (default
# configs/smol/01_build_pairs.yaml); PAIRS_RUN, SFT_RUN: finished runs to start from; SUMMARY_DIR
# (default RUNS_DIR). Prints the report's and the summary's paths.
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
JUDGE=${JUDGE:-03_train_reward_smol.yaml}

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
sft=${SFT_RUN:-$(stage 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs")}
judge=$(stage 03_train_reward.py --config "$RECIPE/$JUDGE" --pairs_run "$pairs")
heldout=$(stage 03_train_reward.py --config "$RECIPE/$JUDGE" --pairs_run "$pairs" \
  --train_split dev --audit_split test --run_name "$(basename "$judge")_HeldOut")
grpo=$(stage 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" --sft_run "$sft" --reward_run "$judge")
dpo=$(stage 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft")
orpo=$(stage 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --loss orpo)
evalrun=$(stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --reward_run "$judge" \
  --judge_runs "$heldout" --sft_run "$sft" --policy_runs "$grpo" "$dpo" "$orpo")
"$PY" scripts/persuasion_real_weights.py "$evalrun" "$SUMMARY_DIR"

echo
echo "persuasion on real weights finished in $(( $(date +%s) - start )) s; runs: $pairs $sft $judge $heldout $grpo $dpo $orpo $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
