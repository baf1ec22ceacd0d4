#!/usr/bin/env bash
# Persuasion on real weights, end to end (docs/results.md, "Real weights: persuasion"):
#   01 (split by period: dev_later and test = the later posts)
#   -> SFT on the winners, beside the judge candidates (scripts/judges_later_posts.sh): the one chosen on
#      dev_later is the training judge (`best` there); its recipe then trains the held-out judges: a 2-fold cross-fit
#      on the test posts (with dev and dev_later), and one on the dev posts
#   -> the decoding chosen on the dev premises (base and SFT, the training judge; DECODINGS below)
#   -> practice: GRPO recipes from SFT (GRPO_RECIPES below) and one from the base, DPO, ORPO and RAFT (and
#      RAFT_GREEDY=1's raft_greedy)
#   -> 05 on every test premise: base, SFT, best_of_n, each GRPO recipe (the one whose own reward rose
#      most first, as `grpo`), grpo_from_base, DPO, ORPO, RAFT, under the training judge and the held-out ones
#   -> the summary (scripts/persuasion_real_weights.py): SUMMARY_DIR/persuasion_real_weights.json and
#      persuasion_grpo_rewards.png.
# Held-out judges (posts the policy never saw: dev and the test folds): the cross-fit and the dev judge in
# the training judge's recipe, and a dev judge (dev and dev_later posts) in the recipe of the best judge
# on dev_later of each of the OTHER_FAMILIES (default 2) best other families (scripts/judges_later_posts.py
# families): 05's verdict needs two families. FLUENCY_MODEL (a causal LM, best of another family than the
# writer): 05 checks every reply's fluency under it, and the GRPO recipe par_fluency_gate runs: the judge
# as PAR, replies below SFT's fluency gated to 0, a KL anchor to SFT (GATE_BETA, default 0.04); every GRPO recipe
# then saves a checkpoint every CHECKPOINT_EVAL_STEPS (default 4) steps and keeps the one chosen on dev by the best
# judges of the other families and the fluency check, and the summary names the recipe chosen on dev among them
# (grpo_chosen_on_dev, its eval row and verdict line). DECODING: the decoding's arguments, chosen on dev
# earlier (skips the sweep). FROM_BASE=0 skips GRPO from the base; PREFERENCE=0 DPO and ORPO; CROSSFIT=0 the
# cross-fit. SFT_RUN: a finished SFT run to start from; SFT_ARGS: more arguments for SFT. RESUME=1 (scripts/demo_lib.sh) goes
# on from a chain that stopped: every finished stage is taken as it is. MAX_JOBS: stages at once.
# HARD_NEGATIVES=1: the training judge's second round on the practised policy's replies (step 3b).
# FRAMINGS: a file of prompt framings (system prompts) to choose among on dev before anything trains (step 0).
# RECIPE: the recipe folder (default configs/smol-gpu; the test runs configs/tiny; configs/qwen-gpu with
# MAX_PREMISES=100 and PAIRS_CONFIG=configs/qwen-gpu/01_build_pairs.yaml: Qwen2.5-Coder-1.5B); PAIRS_CONFIG
# (default configs/smol/01_build_pairs.yaml); PAIRS_RUN: a finished pairs run to start from; MINILM,
# SMOL, ENCODER_JUDGE, DECODER_JUDGE, CANDIDATES_FILE: as scripts/judges_later_posts.sh; GRPO_ONLY: the GRPO recipes
# to run (default all); GRPO_ARGS: more arguments for every GRPO run (e.g.
# --max_prompts 256); BEST_OF_N (default 4); MAX_PREMISES (default 1000: every one) of dev and test; SUMMARY_DIR (default RUNS_DIR); LOGS (default
# RUNS_DIR/logs): one log a stage. Prints each model's verdict, the GRPO recipe chosen on dev, and the report's and
# the summary's paths.
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/smol-gpu}
PAIRS_CONFIG=${PAIRS_CONFIG:-configs/smol/01_build_pairs.yaml}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
LOGS=${LOGS:-$RUNS_DIR/logs}
GRPO_ARGS=${GRPO_ARGS:-}
CHECKPOINT_EVAL_STEPS=${CHECKPOINT_EVAL_STEPS:-4}
BEST_OF_N=${BEST_OF_N:-4}
MAX_PREMISES=${MAX_PREMISES:-1000}
OTHER_FAMILIES=${OTHER_FAMILIES:-2}
FLUENCY_MODEL=${FLUENCY_MODEL:-}
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
# the anchored, gated recipe (its dev judge is only known after the sweep: DEV_JUDGE below)
# GATE_BETA: its KL anchor's strength, 0.04 as chosen on dev among 0.01, 0.04 and 0.1 (docs/results.md, ninth run)
# A number the chain would hand a stage minutes later is checked before anything trains (a comma, a typo).
for b in ${GATE_BETA:-} ${GRPO_BETAS:-}; do
  [[ $b =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] || { echo "error: GATE_BETA / GRPO_BETAS: '$b' is not a KL weight (a number >= 0;" \
    "GRPO_BETAS takes them space-separated)" >&2; exit 1; }; done
for k in $CHECKPOINT_EVAL_STEPS ${GRPO_SPG:-}; do
  [[ $k =~ ^[1-9][0-9]*$ ]] || { echo "error: CHECKPOINT_EVAL_STEPS / GRPO_SPG: '$k' is not a whole number of steps" \
    "(> 0; GRPO_SPG takes them space-separated)" >&2; exit 1; }; done
for w in ${DECODING:-}; do  # GRPO's checkpoint choice takes the same three fields (--checkpoint_<field>)
  [[ $w != --* || $w =~ ^--(temperature|repetition_penalty|no_repeat_ngram_size)$ ]] || { echo "error: DECODING:" \
    "'$w' is none of --temperature, --repetition_penalty, --no_repeat_ngram_size" >&2; exit 1; }; done
gate="--learning_rate 1e-4 --reward_funcs par fluency --reward_weights 1 1 --fluency_mode gate"  # + the loop's fluency model
[[ -n $FLUENCY_MODEL ]] && GRPO_RECIPES[par_fluency_gate]="$gate --beta ${GATE_BETA:-0.04}"
# GRPO_BETAS: that recipe at other strengths, one more recipe a value (par_fluency_gate_betaB), chosen among on
# dev by the summary (grpo_chosen_on_dev: the recipe whose chosen checkpoint wins most against SFT's replies)
# GRPO_SPG: TRL's steps_per_generation for that recipe, one more recipe a value (par_fluency_gate_spgK): with K
# a multiple of its gradient_accumulation_steps, one rollout feeds K / that optimiser steps; its reward curve
# beside the recipe's own shows what sharing rollouts costs in learning (docs/performance.md)
if [[ -n $FLUENCY_MODEL ]]; then
  for b in ${GRPO_BETAS:-}; do GRPO_RECIPES[par_fluency_gate_beta$b]="$gate --beta $b"; done
  for k in ${GRPO_SPG:-}; do
    GRPO_RECIPES[par_fluency_gate_spg$k]="${GRPO_RECIPES[par_fluency_gate]} --steps_per_generation $k"
  done
fi
for name in ${GRPO_ONLY:-}; do  # a misspelt recipe is found before anything trains
  [[ -v "GRPO_RECIPES[$name]" ]] || { echo "error: GRPO_ONLY names $name, not a GRPO recipe here (${!GRPO_RECIPES[*]};" \
    "par_fluency_gate and its betas and spg values need FLUENCY_MODEL)" >&2; exit 1; }
done

# 0. The prompt's framing, chosen on dev (FRAMINGS: a file of `NAME SYSTEM PROMPT` lines, NAME `none` for no
#    system turn of ours): a pairs run for each framing, a feature judge trained on it, and the base model's
#    replies to MAX_PREMISES dev premises scored by it; the framing whose base replies are refused least, then
#    scored highest, frames every later stage (scripts/persuasion_real_weights.py framing). A framing step that
#    fails leaves PAIRS_CONFIG's own framing, and says so.
pairs=${PAIRS_RUN:-}
if [[ -z $pairs && -n ${FRAMINGS:-} ]]; then
  framings=()
  while read -r name prompt; do
    [[ -z $name || $name == \#* ]] && continue
    system=(); [[ $name != none ]] && system=(--system_prompt "$prompt")
    background "framing_pairs_$name" 01_build_pairs.py --config "$PAIRS_CONFIG" "${system[@]}" --run_name "Pairs_framing_$name"
    framings+=("$name")
  done < "$FRAMINGS"
  wait_for_all --allow_failures
  for name in "${framings[@]}"; do
    [[ -s "$LOGS/framing_pairs_$name.dir" ]] && background "framing_judge_$name" 03_train_reward.py \
      --config "$RECIPE/03_train_reward_features.yaml" --pairs_run "$(cat "$LOGS/framing_pairs_$name.dir")" \
      --run_name "Judge_framing_$name"
  done
  wait_for_all --allow_failures
  for name in "${framings[@]}"; do
    # shellcheck disable=SC2086  # the decoding's words are separate arguments
    [[ -s "$LOGS/framing_judge_$name.dir" ]] && background "framing_eval_$name" 05_eval.py \
      --config "$RECIPE/05_eval.yaml" --pairs_run "$(cat "$LOGS/framing_pairs_$name.dir")" \
      --reward_run "$(cat "$LOGS/framing_judge_$name.dir")" --split dev --max_premises "$MAX_PREMISES" \
      ${DECODING:-} --run_name "Framing_$name"
  done
  wait_for_all --allow_failures
  sweep=(); for name in "${framings[@]}"; do
    [[ -s "$LOGS/framing_eval_$name.dir" ]] && sweep+=("$name=$(cat "$LOGS/framing_eval_$name.dir")"); done
  (( ${#sweep[@]} )) && pairs=$("$PY" scripts/persuasion_real_weights.py framing "$SUMMARY_DIR" "${sweep[@]}") || pairs=""
  if [[ -n $pairs ]]; then echo "framing (chosen on dev): $pairs" >&2
  else echo "framing: no framing run finished (failed: ${FAILED[*]:-none}); the pairs of $PAIRS_CONFIG as it is" >&2; fi
fi

# 1. Pairs; SFT in the background while the judge candidates train and the training judge is picked on dev_later
#    (the best of those that pass the gibberish audit, else the hardest to fool of those level with the best).
pairs=${pairs:-$(stage 01_build_pairs.py --config "$PAIRS_CONFIG")}
# shellcheck disable=SC2086
[[ -n ${SFT_RUN:-} ]] || background sft 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs" --run_name SFT ${SFT_ARGS:-}
best=$(PAIRS_RUN="$pairs" RECIPE_03="$RECIPE" LOGS="$LOGS/judges" bash scripts/judges_later_posts.sh | tail -1) \
  || { echo "error: scripts/judges_later_posts.sh failed (logs in $LOGS/judges)" >&2; exit 1; }
read -r _ judge_name judge <<<"$best"
echo "training judge (chosen on dev_later): $judge_name $judge" >&2
singles=(); for dir in "$LOGS"/judges/*.dir; do
  name=$(basename "$dir" .dir); [[ $name == ensemble_* ]] || singles+=("$name=$(cat "$dir")"); done
mapfile -t others < <("$PY" scripts/judges_later_posts.py families --not "$judge_name" "${singles[@]}" | head -n "$OTHER_FAMILIES")
# the GRPO checkpoints' dev judges: the best of each other family (their win rates against SFT's replies, averaged)
DEV_JUDGE=""; for other in "${others[@]}"; do DEV_JUDGE+="${DEV_JUDGE:+ }run:$(cut -d' ' -f2 <<<"$other")"; done
echo "held-out judges of other families, in the recipes of: ${others[*]:-none}" >&2

# 2. The held-out judges: in the training judge's recipe (its config.yaml) and in the best recipe of each
#    other family; the decoding sweep on dev (unless DECODING gives the one chosen earlier).
recipe=(--config "$judge/config.yaml" --pairs_run "$pairs")
if [[ ${CROSSFIT:-1} == 1 ]]; then
  background crossfit0 03_train_reward.py "${recipe[@]}" --train_split test --train_also dev dev_later \
    --cross_fit_folds 2 --cross_fit_fold 0 --audit_split train --audit_extra_splits test --run_name HeldOut_CrossFit0
  background crossfit1 03_train_reward.py "${recipe[@]}" --train_split test --train_also dev dev_later \
    --cross_fit_folds 2 --cross_fit_fold 1 --audit_split train --audit_extra_splits test --run_name HeldOut_CrossFit1
fi
background heldout_dev 03_train_reward.py "${recipe[@]}" --train_split dev --audit_split test \
  --audit_extra_splits dev_later --run_name HeldOut_Dev
heldout=(heldout_dev)
for line in "${others[@]}"; do
  read -r name run _ <<<"$line"
  background "heldout_$name" 03_train_reward.py --config "$run/config.yaml" --pairs_run "$pairs" --train_split dev \
    --train_also dev_later --audit_split test --run_name "HeldOut_Dev_$name"
  heldout+=("heldout_$name")
done
wait_for_all
sft=${SFT_RUN:-$(cat "$LOGS/sft.dir")}
if [[ -n ${DECODING:-} ]]; then
  decoding=$DECODING
else
  for name in "${!DECODINGS[@]}"; do
    # shellcheck disable=SC2086  # the decoding's words are separate arguments
    background "decoding_$name" 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --reward_run "$judge" \
      --sft_run "$sft" --split dev --max_premises "$MAX_PREMISES" ${DECODINGS[$name]} --run_name "Decoding_$name"
  done
  wait_for_all
  sweep=(); for name in "${!DECODINGS[@]}"; do sweep+=("$name=$(cat "$LOGS/decoding_$name.dir")"); done
  decoding=$("$PY" scripts/persuasion_real_weights.py decoding "$SUMMARY_DIR" "${sweep[@]}")
fi
echo "decoding (chosen on dev): $decoding" >&2

# 3. Practice. A GRPO recipe stopped by its length guard is a finding, not a failure of the chain.
#    GRPO_ONLY (names of GRPO_RECIPES) runs a subset: a larger writer on one GPU has time for fewer.
for name in ${GRPO_ONLY:-"${!GRPO_RECIPES[@]}"}; do
  args=${GRPO_RECIPES[$name]}
  # With a fluency model (the gated recipes' fluency term reads it too) every recipe keeps the step chosen on dev,
  # so that the summary's choice among the recipes (grpo_chosen_on_dev) compares them all alike; its checkpoints'
  # dev replies are decoded as the eval will decode the kept one (the decoding chosen on dev).
  if [[ -n $FLUENCY_MODEL ]]; then
    args+=" --fluency_model_name_or_path $FLUENCY_MODEL --checkpoint_eval_steps $CHECKPOINT_EVAL_STEPS"
    args+=" --dev_judges ${DEV_JUDGE:-judge} ${decoding//--/--checkpoint_}"
  fi
  # shellcheck disable=SC2086
  background "grpo_$name" 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" --sft_run "$sft" \
    --reward_run "$judge" $args $GRPO_ARGS --run_name "GRPO_$name"
done
# shellcheck disable=SC2086
[[ ${FROM_BASE:-1} == 1 ]] && background grpo_from_base 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" \
  --pairs_run "$pairs" --reward_run "$judge" --learning_rate 1e-4 $GRPO_ARGS --run_name GRPO_from_base_lr1e-4
# PREFERENCE=0 skips DPO and ORPO (a chain that measures GRPO or a judge's second round alone)
if [[ ${PREFERENCE:-1} == 1 ]]; then
  background dpo 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --run_name DPO
  background orpo 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --loss orpo --run_name ORPO
fi
# RAFT, the cheap alternative (common/raft.py): SFT's best of BEST_OF_N samples on MAX_PREMISES train premises,
# picked by the training judge among those that pass the fluency gate, then SFT's adapter trained on the picks
# (`--sft_run`: RAFT continues the policy that sampled them; before 2026-12-06 a fresh adapter on the base learned
# them, which confounds the picks with 100 examples against SFT's 857). RAFT=0 skips it.
fluency=(); [[ -n $FLUENCY_MODEL ]] && fluency=(--fluency_model_name_or_path "$FLUENCY_MODEL")
# RAFT_GREEDY=1 adds raft_greedy: SFT's greedy reply is a candidate too (best_of_n_with_greedy), so that a pick
# is never a sample less fluent than the gate asks (most picks of the third run were: no sample passed). Both
# RAFTs then train on one generation: the plain one picks among its samples alone (targets_without_greedy).
# The eval's best_of_n then has SFT's greedy reply among its candidates too.
if [[ ${RAFT:-1} == 1 ]]; then
  greedy=(); plain=(); [[ ${RAFT_GREEDY:-0} == 1 ]] && greedy=(--best_of_n_with_greedy true) plain=(--targets_without_greedy true)
  # shellcheck disable=SC2086
  background raft_targets 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --sft_run "$sft" \
    --split train --evaluate_base false --best_of_n "$BEST_OF_N" --best_of_n_scorer "run:$judge" "${fluency[@]}" \
    "${greedy[@]}" --max_premises "$MAX_PREMISES" $decoding --run_name RAFT_Targets
  # its SFT as soon as its targets are written, beside the other practice stages
  background raft --after raft_targets 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs" \
    --sft_run "$sft" --targets_from @raft_targets "${plain[@]}" --run_name RAFT
  if [[ ${RAFT_GREEDY:-0} == 1 ]]; then
    background raft_greedy --after raft_targets 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" \
      --pairs_run "$pairs" --sft_run "$sft" --targets_from @raft_targets --run_name RAFT_Greedy
  fi
fi
wait_for_all --allow_failures
recipes=(); for name in ${GRPO_ONLY:-"${!GRPO_RECIPES[@]}"}; do
  [[ -s "$LOGS/grpo_$name.dir" ]] && recipes+=("$name=$(cat "$LOGS/grpo_$name.dir")"); done
# no GRPO recipe finished (its length guard stopped each, say): the eval still compares the practice that did
grpo=()
if (( ${#recipes[@]} )); then
  mapfile -t grpo < <("$PY" scripts/persuasion_real_weights.py rising "${recipes[@]}")
else
  echo "no GRPO recipe finished (failed: ${FAILED[*]:-none}; stopped by their length guard: ${STOPPED[*]:-none}):" \
    "the eval compares the other practice" >&2
fi
policies=("${grpo[@]}")
for name in grpo_from_base dpo orpo raft raft_greedy; do [[ -s "$LOGS/$name.dir" ]] && policies+=("$(cat "$LOGS/$name.dir")"); done
(( ${#policies[@]} )) || { echo "error: no practice stage finished (failed: ${FAILED[*]:-none}; stopped by their" \
  "length guard: ${STOPPED[*]:-none}): nothing to compare" >&2; exit 1; }

# 3b. The judge's second round (HARD_NEGATIVES=1): the GRPO policy whose reward rose most answers MAX_PREMISES
#     train premises beside the eval below (the eval is what a chain short of time must not lose); its replies
#     then become losers against the real winners of those posts in the training judge's recipe (03
#     --hard_negatives), and the levers table gets its row. An ensemble trains on no such pairs (its members
#     do): the step says so and is skipped.
hard=0
if [[ ${HARD_NEGATIVES:-0} == 1 && ${#grpo[@]} == 0 ]]; then
  echo "hard negatives: no GRPO policy finished to answer the train premises; skipped" >&2
elif [[ ${HARD_NEGATIVES:-0} == 1 ]]; then
  backbone=$(sed -n 's/^judge_backbone: *//p' "$judge/config.yaml" 2>/dev/null || true)
  if [[ $backbone == ensemble ]]; then
    echo "hard negatives: the training judge ($judge_name, $backbone) trains on no extra pairs; skipped" >&2
  else
    hard=1
    # shellcheck disable=SC2086
    background hard_replies 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --sft_run "$sft" \
      --policy_runs "${grpo[0]}" --split train --evaluate_base false --max_premises "$MAX_PREMISES" $decoding \
      --run_name HardNegative_Replies
  fi
fi

# 4. Every test premise, every model, every judge; the summary.
crossfit=(); [[ ${CROSSFIT:-1} == 1 ]] && crossfit=(--crossfit_judge_runs "$(cat "$LOGS/crossfit0.dir")" "$(cat "$LOGS/crossfit1.dir")")
judges=(); for name in "${heldout[@]}"; do judges+=("$(cat "$LOGS/$name.dir")"); done
bon_greedy=(); [[ ${RAFT_GREEDY:-0} == 1 ]] && bon_greedy=(--best_of_n_with_greedy true)
# shellcheck disable=SC2086
evalrun=$(stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --reward_run "$judge" \
  --judge_runs "${judges[@]}" "${fluency[@]}" "${crossfit[@]}" \
  --sft_run "$sft" --policy_runs "${policies[@]}" --best_of_n "$BEST_OF_N" "${bon_greedy[@]}" \
  --max_premises "$MAX_PREMISES" $decoding)
# the summary's reward curves: those a length guard stopped too, up to where it stopped them
curves=("${recipes[@]}"); for name in "${STOPPED[@]}"; do
  run=$(sed -n 's/.* run directory //p' "$LOGS/$name.log" | head -1); [[ -n $run ]] && curves+=("${name#grpo_}=$run"); done
"$PY" scripts/persuasion_real_weights.py summary "$evalrun" "$SUMMARY_DIR" "${curves[@]}"
if [[ $hard == 1 ]]; then
  wait_for_all --allow_failures
  if [[ -s "$LOGS/hard_replies.dir" ]]; then
    hardened="$judge_name+hard_negatives"
    background hard_negatives 03_train_reward.py --config "$judge/config.yaml" --pairs_run "$pairs" \
      --hard_negatives "$(cat "$LOGS/hard_replies.dir"):grpo" --run_name "Judge_$hardened"
    wait_for_all --allow_failures
    [[ -s "$LOGS/hard_negatives.dir" ]] && "$PY" scripts/judges_later_posts.py add_lever "$SUMMARY_DIR" "hard negatives" \
      "$hardened=$(cat "$LOGS/hard_negatives.dir")" "$judge_name=$judge"
  fi
fi

echo
finish_chain "persuasion on real weights" "pairs $pairs, judge $judge, eval $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
