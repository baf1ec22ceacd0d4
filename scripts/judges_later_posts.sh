#!/usr/bin/env bash
# Judges on later posts: 01 with split_by period (the source's later posts held out: dev_later, where a
# judge is chosen, and test, where it is reported), then candidate judges trained on its train split and
# judged on dev_later, dev (in-period) and test, all at once:
#   MiniLM pairwise (the recipe), with a longer premise (256 tokens), at lr 5e-5 for 3 epochs, with
#   another seed; MiniLM pointwise; MiniLM on the reply alone (premise cut to one token); the SmolLM2
#   decoder judge (4-bit + rsLoRA) at its recipe's lr and at 3e-4; the ensemble of the two best on
#   dev_later (scripts/judge_ensemble.py); the feature judge (Tan et al. 2016); the candidates of
#   CANDIDATES_FILE; then conservative ensembles (stage 03's judge_backbone ensemble: min and
#   mean - sd of the z-scored members) of the ENSEMBLE_SIZES best single judges on dev_later
#   -> SUMMARY_DIR/judges_later_posts.json (scripts/judges_later_posts.py): each candidate on dev_later
#      and test with intervals, both baselines, `default: true` on the best single judge on dev_later,
#      and `levers`: what each lever added on dev_later (paired intervals), also as judges_later_posts.md.
#   Prints `best: NAME RUN_DIR` last, the best single judge (scripts/persuasion_real_weights.sh reads it).
# CANDIDATES_FILE: more candidates, one a line, `NAME ARGS...` (stage-03 arguments: `--config PATH`
# and any others; blank and # lines skipped), e.g. `mpnet_pairwise --config configs/qwen-gpu/X.yaml`.
# `NAME+LEVER` (e.g. `minilm_pairwise+corruptions ... --corruptions ...`) is NAME with one lever more:
# the levers table gives what it added over NAME. BUILTIN=0 runs only the file's candidates (and the
# ensembles). ENSEMBLE_SIZES (default "2 3"; empty: none). TWO_JUDGE_ENSEMBLE=0 leaves out the ensemble of the
# two best (scripts/judge_ensemble.py), for a sweep whose candidates were measured already.
# RECIPE_03: the stage-03 recipe folder (default configs/smol-gpu; the test runs configs/tiny);
# PAIRS_CONFIG: the stage-01 recipe (default configs/smol/01_build_pairs.yaml); PAIRS_RUN: a
# finished period pairs run to start from instead; MINILM: the encoder (a folder with config.json and
# weights; default the recipe's judge_model_name_or_path); SMOL: the decoder judge's model folder
# (default the recipe's); ENCODER_JUDGE, DECODER_JUDGE: which recipe files fill the encoder and decoder
# slots, RECIPE_03/03_train_reward_<name>.yaml (and <name>_pointwise.yaml; default minilm and smol; e.g.
# mpnet, qwen05, gemma270 in configs/qwen-gpu; the candidates keep their slot names); FEATURES_CONFIG
# (default RECIPE_03's 03_train_reward_features.yaml); SUMMARY_DIR (default RUNS_DIR); LOGS (default
# RUNS_DIR/logs): one log a stage.
source "$(dirname "$0")/demo_lib.sh"
RECIPE_03=${RECIPE_03:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
FEATURES_CONFIG=${FEATURES_CONFIG:-$RECIPE_03/03_train_reward_features.yaml}  # the feature judge; the ensembles' runs
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
LOGS=${LOGS:-$RUNS_DIR/logs}
mkdir -p "$SUMMARY_DIR" "$LOGS"

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
ENCODER_JUDGE=${ENCODER_JUDGE:-minilm}
DECODER_JUDGE=${DECODER_JUDGE:-smol}
encoder=${MINILM:+ --judge_model_name_or_path $MINILM}
minilm="--config $RECIPE_03/03_train_reward_$ENCODER_JUDGE.yaml$encoder"
smol="--config $RECIPE_03/03_train_reward_$DECODER_JUDGE.yaml${SMOL:+ --judge_model_name_or_path $SMOL}"
declare -A CANDIDATES=()
if [[ ${BUILTIN:-1} == 1 ]]; then
  CANDIDATES=(
    [minilm_pairwise]="$minilm"
    [minilm_pairwise_premise256]="$minilm --max_prompt_tokens 256 --max_length 512"
    [minilm_pairwise_lr5e-5_3ep]="$minilm --learning_rate 5e-5 --num_train_epochs 3"
    [minilm_pairwise_seed7]="$minilm --seed 7"
    [minilm_pointwise]="--config $RECIPE_03/03_train_reward_${ENCODER_JUDGE}_pointwise.yaml$encoder"
    [minilm_pairwise_reply_only]="$minilm --max_prompt_tokens 1"
    [smollm2_decoder]="$smol"
    [smollm2_decoder_lr3e-4]="$smol --learning_rate 3e-4"
    [features]="--config $FEATURES_CONFIG"
  )
fi
if [[ -n ${CANDIDATES_FILE:-} ]]; then
  while read -r name args || [[ -n $name ]]; do  # a last line without its newline too
    [[ -z $name || $name == \#* ]] && continue
    [[ -z ${CANDIDATES[$name]+set} ]] || { echo "error: $CANDIDATES_FILE: candidate $name given twice" >&2; exit 1; }
    CANDIDATES[$name]=$args
  done < "$CANDIDATES_FILE"
fi
for name in "${!CANDIDATES[@]}"; do  # word splitting of the arguments is meant: paths hold no spaces here
  # shellcheck disable=SC2086
  background "$name" 03_train_reward.py ${CANDIDATES[$name]} --pairs_run "$pairs" --audit_split dev_later \
    --audit_extra_splits dev test --run_name "Judge_$name"
done
wait_for_all --allow_failures  # a candidate that fails is named (its log's end) and left out of the table
judges=()
for name in "${!CANDIDATES[@]}"; do [[ -s "$LOGS/$name.dir" ]] && judges+=("$name=$(cat "$LOGS/$name.dir")"); done
(( ${#judges[@]} )) || { echo "error: no judge candidate finished (logs in $LOGS)" >&2; exit 1; }
two_judges=()  # TWO_JUDGE_ENSEMBLE=0: no ensemble of the two best (it loads both judges; a minute of a GPU machine)
if [[ ${TWO_JUDGE_ENSEMBLE:-1} == 1 ]]; then
  mapfile -t two < <("$PY" scripts/judges_later_posts.py best2 "${judges[@]}")
  "$PY" scripts/judge_ensemble.py "${two[@]}" --out "$SUMMARY_DIR/judges_later_posts_ensemble.json"
  two_judges=(--ensemble "$SUMMARY_DIR/judges_later_posts_ensemble.json")
fi
# Conservative ensembles of the k best single judges on dev_later, as stage-03 runs (04 and 05 take them).
ensembles=()
for k in ${ENSEMBLE_SIZES-2 3}; do
  mapfile -t members < <("$PY" scripts/judges_later_posts.py best2 --k "$k" "${judges[@]}")
  (( ${#members[@]} == k )) || continue  # fewer single judges than k
  for how in min mean_minus_std; do
    background "ensemble_${how}_best$k" 03_train_reward.py --config "$FEATURES_CONFIG" \
      --judge_backbone ensemble --ensemble_of "${members[@]}" --ensemble_combine "$how" --pairs_run "$pairs" \
      --audit_split dev_later --audit_extra_splits dev test --run_name "Judge_ensemble_${how}_best$k"
    ensembles+=("ensemble_${how}_best$k")
  done
done
wait_for_all --allow_failures
failed=("${FAILED[@]}")
singles=("${judges[@]}")
for name in "${ensembles[@]}"; do [[ -s "$LOGS/$name.dir" ]] && judges+=("$name=$(cat "$LOGS/$name.dir")"); done
"$PY" scripts/judges_later_posts.py summary "$SUMMARY_DIR" "${judges[@]}" "${two_judges[@]}" \
  ${failed[@]:+--failed "${failed[@]}"}
echo "judges on later posts finished in $(( $(date +%s) - start )) s; pairs run: $pairs"
echo "summary: $(cd "$SUMMARY_DIR" && pwd)/judges_later_posts.json"
"$PY" scripts/judges_later_posts.py best "${singles[@]}"
