#!/usr/bin/env bash
# Persuasion on real weights, end to end (docs/results.md, "Real weights: persuasion"):
#   01 (split by period: dev_later and test = the later posts)
#   -> SFT on the winners, beside the judge candidates (scripts/judges_later_posts.sh): the best on
#      dev_later is the training judge; its recipe then trains the held-out judges: a 2-fold cross-fit
#      on the test posts (with dev and dev_later), and one on the dev posts
#   -> the decoding chosen on the dev premises (base and SFT, the training judge; DECODINGS below)
#   -> practice: GRPO recipes from SFT (GRPO_RECIPES below) and one from the base, DPO and ORPO
#   -> 05 on every test premise: base, SFT, best_of_n, each GRPO recipe (the one whose own reward rose
#      most first, as `grpo`), grpo_from_base, DPO, ORPO, under the training judge and both held-out ones
#   -> the summary (scripts/persuasion_real_weights.py): SUMMARY_DIR/persuasion_real_weights.json and
#      persuasion_grpo_rewards.png.
# RECIPE: the recipe folder (default configs/smol-gpu; the test runs configs/tiny; configs/qwen-gpu with
# MAX_PREMISES=100 and PAIRS_CONFIG=configs/qwen-gpu/01_build_pairs.yaml: Qwen2.5-Coder-1.5B); PAIRS_CONFIG
# (default configs/smol/01_build_pairs.yaml); PAIRS_RUN: a finished pairs run to start from; MINILM,
# SMOL, ENCODER_JUDGE, DECODER_JUDGE, CANDIDATES_FILE: as scripts/judges_later_posts.sh; GRPO_ONLY: the GRPO recipes
# to run (default all); GRPO_ARGS: more arguments for every GRPO run (e.g.
# --max_prompts 256); BEST_OF_N (default 4); MAX_PREMISES (default 1000: every one) of dev and test; SUMMARY_DIR (default RUNS_DIR); LOGS (default
# RUNS_DIR/logs): one log a stage. Prints the report's and the summary's paths.
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
LOGS=${LOGS:-$RUNS_DIR/logs}
GRPO_ARGS=${GRPO_ARGS:-}
BEST_OF_N=${BEST_OF_N:-4}
MAX_PREMISES=${MAX_PREMISES:-1000}
mkdir -p "$SUMMARY_DIR" "$LOGS"
declare -A DECODINGS=(  # each sets all three fields: the recipe's own decoding is not a starting point
  [greedy]="--temperature 0 --repetition_penalty 1 --no_repeat_ngram_size 0"
  [greedy_repetition_penalty_1.2]="--temperature 0 --repetition_penalty 1.2 --no_repeat_ngram_size 0"
  [greedy_no_4gram_twice]="--temperature 0 --repetition_penalty 1 --no_repeat_ngram_size 4"
  [sampled_0.7_no_4gram_twice]="--temperature 0.7 --repetition_penalty 1 --no_repeat_ngram_size 4"
  [sampled_1.0]="--temperature 1.0 --repetition_penalty 1 --no_repeat_ngram_size 0"
)
declare -A GRPO_RECIPES=(
  [lr2e-5]="--learning_rate 2e-5"
  [lr1e-4]="--learning_rate 1e-4"
  [lr1e-4_beta0.04_temperature0.8]="--learning_rate 1e-4 --beta 0.04 --temperature 0.8"
  [lr3e-4_unscaled]="--learning_rate 3e-4 --scale_rewards none"
)

# 1. Pairs; SFT in the background while the judge candidates train and the best on dev_later is picked.
pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
background sft 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs"
best=$(PAIRS_RUN="$pairs" RECIPE_03="$RECIPE" LOGS="$LOGS/judges" bash scripts/judges_later_posts.sh | tail -1) \
  || { echo "error: scripts/judges_later_posts.sh failed (logs in $LOGS/judges)" >&2; exit 1; }
read -r _ judge_name judge <<<"$best"
echo "training judge (best on dev_later): $judge_name $judge" >&2

# 2. The held-out judges, in the training judge's recipe (its config.yaml), and the decoding sweep on dev.
recipe=(--config "$judge/config.yaml" --pairs_run "$pairs")
background crossfit0 03_train_reward.py "${recipe[@]}" --train_split test --train_also dev dev_later \
  --cross_fit_folds 2 --cross_fit_fold 0 --audit_split train --audit_extra_splits test --run_name HeldOut_CrossFit0
background crossfit1 03_train_reward.py "${recipe[@]}" --train_split test --train_also dev dev_later \
  --cross_fit_folds 2 --cross_fit_fold 1 --audit_split train --audit_extra_splits test --run_name HeldOut_CrossFit1
background heldout_dev 03_train_reward.py "${recipe[@]}" --train_split dev --audit_split test \
  --audit_extra_splits dev_later --run_name HeldOut_Dev
wait_for_all
sft=$(cat "$LOGS/sft.dir")
for name in "${!DECODINGS[@]}"; do
  # shellcheck disable=SC2086  # the decoding's words are separate arguments
  background "decoding_$name" 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --reward_run "$judge" \
    --sft_run "$sft" --split dev --max_premises "$MAX_PREMISES" ${DECODINGS[$name]} --run_name "Decoding_$name"
done
wait_for_all
sweep=(); for name in "${!DECODINGS[@]}"; do sweep+=("$name=$(cat "$LOGS/decoding_$name.dir")"); done
decoding=$("$PY" scripts/persuasion_real_weights.py decoding "$SUMMARY_DIR" "${sweep[@]}")
echo "decoding (chosen on dev): $decoding" >&2

# 3. Practice. A GRPO recipe stopped by its length guard is a finding, not a failure of the chain.
#    GRPO_ONLY (names of GRPO_RECIPES) runs a subset: a larger writer on one GPU has time for fewer.
for name in ${GRPO_ONLY:-"${!GRPO_RECIPES[@]}"}; do
  # shellcheck disable=SC2086
  background "grpo_$name" 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" --sft_run "$sft" \
    --reward_run "$judge" ${GRPO_RECIPES[$name]} $GRPO_ARGS --run_name "GRPO_$name"
done
# shellcheck disable=SC2086
background grpo_from_base 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" --pairs_run "$pairs" \
  --reward_run "$judge" --learning_rate 1e-4 $GRPO_ARGS --run_name GRPO_from_base_lr1e-4
background dpo 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft"
background orpo 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --loss orpo
wait_for_all --allow_failures
recipes=(); for name in ${GRPO_ONLY:-"${!GRPO_RECIPES[@]}"}; do
  [[ -s "$LOGS/grpo_$name.dir" ]] && recipes+=("$name=$(cat "$LOGS/grpo_$name.dir")"); done
(( ${#recipes[@]} )) || { echo "error: no GRPO recipe finished (failed: ${FAILED[*]:-none};" \
  "stopped by their length guard: ${STOPPED[*]:-none}): nothing to compare" >&2; exit 1; }
rising=$("$PY" scripts/persuasion_real_weights.py rising "${recipes[@]}")
mapfile -t grpo <<<"$rising"
policies=("${grpo[@]}")
for name in grpo_from_base dpo orpo; do [[ -s "$LOGS/$name.dir" ]] && policies+=("$(cat "$LOGS/$name.dir")"); done

# 4. Every test premise, every model, every judge; the summary.
# shellcheck disable=SC2086
evalrun=$(stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --reward_run "$judge" \
  --judge_runs "$(cat "$LOGS/heldout_dev.dir")" \
  --crossfit_judge_runs "$(cat "$LOGS/crossfit0.dir")" "$(cat "$LOGS/crossfit1.dir")" \
  --sft_run "$sft" --policy_runs "${policies[@]}" --best_of_n "$BEST_OF_N" --max_premises "$MAX_PREMISES" $decoding)
"$PY" scripts/persuasion_real_weights.py summary "$evalrun" "$SUMMARY_DIR" "${recipes[@]}"

echo
finish_chain "persuasion on real weights" "pairs $pairs, judge $judge, eval $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
