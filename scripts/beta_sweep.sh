#!/usr/bin/env bash
# The KL anchor's strength: stage 04 (GRPO) once per beta, then one stage 05 scoring every policy on the
# pairs run's DEV premises (where a setting is chosen; test stays for the report).
#   SFT_RUN, REWARD_RUN (required): the starting SFT run and the training judge;
#   JUDGE_RUNS: held-out judge runs for 05 (space-separated; the choice should rest on them, not on the
#   training judge); RECIPE (default configs/smol-gpu): the folder of 04_train_grpo.yaml and 05_eval.yaml;
#   BETAS (default "0.01 0.02 0.05 0.1"); EXTRA_04: more stage-04 arguments (e.g. "--max_steps 200").
# Prints the Eval run's directory last: its report.md and eval.json hold one `grpo` row per beta.
source "$(dirname "$0")/demo_lib.sh"
: "${SFT_RUN:?give SFT_RUN}" "${REWARD_RUN:?give REWARD_RUN}"
RECIPE=${RECIPE:-configs/smol-gpu}
BETAS=${BETAS:-0.01 0.02 0.05 0.1}
policies=()
for beta in $BETAS; do
  # shellcheck disable=SC2086  # EXTRA_04 is split into arguments on purpose
  policies+=("$(stage 04_train_grpo.py --config "$RECIPE/04_train_grpo.yaml" --sft_run "$SFT_RUN" \
    --reward_run "$REWARD_RUN" --beta "$beta" --run_name "GRPO_beta$beta" ${EXTRA_04:-})")
done
pairs=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['pairs_run'])" "$SFT_RUN/manifest.json")
# shellcheck disable=SC2086
stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --split dev --sft_run "$SFT_RUN" \
  --reward_run "$REWARD_RUN" --policy_runs "${policies[@]}" ${JUDGE_RUNS:+--judge_runs $JUDGE_RUNS}
echo "beta sweep: $BETAS in $(( $(date +%s) - start )) s" >&2
