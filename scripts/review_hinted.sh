#!/usr/bin/env bash
# The writer told the rating model's rating (docs/review.md, "The written rating agreeing with the judgement"),
# beside the plain writer of the same run:
#   01 -> the rating model (03) beside 02 with --rating_hint_noise NOISE
#   -> 05 on the dev papers: the hinted writer, whose dev reviews fit the blend (any choice is made here)
#   -> 05 on the test papers: the base and the hinted writer, both told the rating model's rating
#   -> PLAIN=1 (the default): the plain 02 and its test eval, the same pairs, rating model and decoding.
# RECIPE: the recipe folder (default configs/qwen-gpu/review; the test runs configs/tiny/review); RATING_CONFIG:
# the rating model's recipe (default SmolLM2's, configs/smol-gpu/review/03_train_rating.yaml, the one the qwen-gpu
# chain kept on dev); NOISE: the hint's noise (default 0.4, about that rating model's dev RMSE); DECODING: the
# decoding flags (default greedy with no 5-gram twice, the qwen-gpu chain's pick on dev); PAIRS_RUN: a finished
# pairs run instead of 01; EVAL_FLAGS: more flags for every 05 run. Stage logs and timeline.tsv in LOGS (default
# RUNS_DIR/logs). Prints the test reports' paths.
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/qwen-gpu/review}
RATING_CONFIG=${RATING_CONFIG:-configs/smol-gpu/review/03_train_rating.yaml}
read -ra DECODING <<<"${DECODING:-"--repetition_penalty 1.0 --no_repeat_ngram_size 5 --temperature 0"}"
read -ra EVAL_FLAGS <<<"${EVAL_FLAGS:-}"
LOGS=${LOGS:-$RUNS_DIR/logs}
mkdir -p "$LOGS"

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$RECIPE/01_build_pairs.yaml")}

# The rating model reads only the pairs run, so it trains beside the hinted writer (on one H100 it doubled SFT's
# training time and still ended after it: docs/results.md, "A writer told the rating model's rating").
background rating 03_train_reward.py --config "$RATING_CONFIG" --pairs_run "$pairs"
hinted=$(stage 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs" \
  --rating_hint_noise "${NOISE:-0.4}")
wait_for_all
rating=$(cat "$LOGS/rating.dir")

evaluate=(05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --rating_run "$rating" "${DECODING[@]}"
  "${EVAL_FLAGS[@]}")
dev=$(stage "${evaluate[@]}" --sft_run "$hinted" --split dev --evaluate_base false)
test_hinted=$(stage "${evaluate[@]}" --sft_run "$hinted" --rating_dev_run "$dev")
runs=("$pairs" "$rating" "$hinted" "$dev" "$test_hinted")
reports=("$test_hinted/report.md")
if [[ ${PLAIN:-1} == 1 ]]; then
  plain=$(stage 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs")
  test_plain=$(stage "${evaluate[@]}" --sft_run "$plain" --evaluate_base false)
  runs+=("$plain" "$test_plain")
  reports+=("$test_plain/report.md")
fi

echo
echo "hinted writer finished in $(( $(date +%s) - start )) s; runs: ${runs[*]}"
echo "reports: ${reports[*]}"
