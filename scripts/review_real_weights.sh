#!/usr/bin/env bash
# The reviewer on real weights, end to end (docs/review.md, "The reviewer on real weights"):
#   01 (every paper) -> 02 (SFT on every train paper, every window)
#   -> 05 on the dev papers, the SFT model once per decoding in DECODINGS; scripts/review_real_weights.py
#      pick keeps the one with the highest format compliance, and the better rating read-out (first
#      window or all windows): the test papers play no part in the choice
#   -> 04 DPO with base-written rejected reviews, DPO with SFT-written ones, ORPO (SFT-written)
#   -> 05 on the test papers: base, SFT, both DPOs, ORPO -> the summary (JSON and the preference curves)
# RECIPE: the recipe folder (default configs/smol-gpu/review; the test runs configs/tiny/review);
# SUMMARY_DIR: where the summary goes (default RUNS_DIR); DECODINGS: the decodings tried, one a line;
# EVAL_FLAGS: more flags for every stage-05 run; PAIRS_RUN, SFT_RUN: finished runs to start from instead
# of running 01 and 02; RATING_CONFIGS: the rating-model recipes trained by stage 03 (default the recipe's
# 03_train_rating*.yaml; empty: none), the one of lowest dev MAE rating every test paper beside the
# reviews' own ratings, with a dev eval of SFT at the picked decoding and reading to fit the blend (docs/review.md,
# "Every rating source"; where the pick reads all windows, the sweep's run is that eval). The rating models train
# in the background beside SFT and the stages after it, which they do not need; DPO, ORPO and the blend's dev eval
# run at once after the pick (every background stage's log in LOGS, default RUNS_DIR/logs; MAX_JOBS: stages at
# once). PREFERENCE=0 skips both DPOs and ORPO (a chain that measures the ratings alone). Prints the report's and
# the summary's paths.
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/smol-gpu/review}
SUMMARY_DIR=${SUMMARY_DIR:-$RUNS_DIR}
# greedy; greedy with a repetition penalty; greedy with no 5-gram twice in a review; sampled (seeded)
mapfile -t DECODINGS <<<"${DECODINGS:-"--repetition_penalty 1.0 --no_repeat_ngram_size 0 --temperature 0
--repetition_penalty 1.2 --no_repeat_ngram_size 0 --temperature 0
--repetition_penalty 1.0 --no_repeat_ngram_size 5 --temperature 0
--repetition_penalty 1.0 --no_repeat_ngram_size 0 --temperature 0.7"}"
read -ra EVAL_FLAGS <<<"${EVAL_FLAGS:-}"

pairs=${PAIRS_RUN:-$(stage 01_build_pairs.py --config "$RECIPE/01_build_pairs.yaml")}

# The rating models (docs/review.md) read only the pairs run: each of RATING_CONFIGS starts now, beside SFT.
read -ra RATING_CONFIGS <<<"${RATING_CONFIGS-$(echo "$RECIPE"/03_train_rating*.yaml)}"
(( ${#RATING_CONFIGS[@]} )) && [[ ! -f ${RATING_CONFIGS[0]} ]] && RATING_CONFIGS=()
LOGS=${LOGS:-$RUNS_DIR/logs}
mkdir -p "$LOGS"
export MAX_JOBS=${MAX_JOBS:-$(gpu_jobs 20)}
for i in "${!RATING_CONFIGS[@]}"; do
  background "rating_$i" 03_train_reward.py --config "${RATING_CONFIGS[i]}" --pairs_run "$pairs"
done

sft=${SFT_RUN:-$(stage 02_train_sft.py --config "$RECIPE/02_train_sft.yaml" --pairs_run "$pairs")}

sweep=()
for decoding in "${DECODINGS[@]}"; do
  # shellcheck disable=SC2086  # the flags are words
  sweep+=("$(stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --sft_run "$sft" --split dev \
    --evaluate_base false --reading all_windows $decoding "${EVAL_FLAGS[@]}")")
done
picked=$("$PY" scripts/review_real_weights.py pick "${sweep[@]}")
decoding=$(sed -n 1p <<<"$picked")
reading=$(sed -n 2p <<<"$picked")
picked_run=$(sed -n 3p <<<"$picked")
echo "picked on the dev papers: $decoding $reading" >&2

# DPO with base-written and with SFT-written rejected reviews, ORPO, and (with rating models) SFT's dev reviews
# at the picked decoding, which fit the blend of the ratings: each reads only SFT's run, so they run at once,
# beside the rating models (MAX_JOBS stages at once, by default as many as the GPU's free memory holds at 20 GiB a
# stage; one that runs out of memory beside the others runs again alone: scripts/demo_lib.sh)
if [[ ${PREFERENCE:-1} == 1 ]]; then
  # shellcheck disable=SC2086  # the flags are words
  background dpo_base 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --rejected_from base $decoding
  # shellcheck disable=SC2086
  background dpo_sft 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --rejected_from sft $decoding
  # shellcheck disable=SC2086
  background orpo 04_train_dpo.py --config "$RECIPE/04_train_dpo.yaml" --sft_run "$sft" --rejected_from sft \
    --loss orpo $decoding
fi
dev_eval=
if (( ${#RATING_CONFIGS[@]} )); then
  if [[ $reading == "--reading all_windows" ]]; then
    dev_eval=$picked_run  # the sweep read all windows at every decoding: its run at the picked one is this eval
  else
    # shellcheck disable=SC2086
    background dev_eval 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --sft_run "$sft" \
      --split dev --evaluate_base false $decoding $reading "${EVAL_FLAGS[@]}"
  fi
fi
wait_for_all
policies=() policy_flags=()
if [[ ${PREFERENCE:-1} == 1 ]]; then
  policies=("$(cat "$LOGS/dpo_base.dir")" "$(cat "$LOGS/dpo_sft.dir")" "$(cat "$LOGS/orpo.dir")")
  policy_flags=(--policy_runs "${policies[@]}")
fi

# The rating model: of RATING_CONFIGS' runs, the one of lowest dev MAE kept, with the blend fitted on SFT's dev
# reviews; and RERANK_N (default 4) sampled SFT reviews a test paper, the one whose rating is nearest the rating
# model's kept.
rating_flags=()
if (( ${#RATING_CONFIGS[@]} )); then
  ratings=()
  for i in "${!RATING_CONFIGS[@]}"; do ratings+=("$(cat "$LOGS/rating_$i.dir")"); done
  rating=$("$PY" -c 'import json, sys
print(min(sys.argv[1:], key=lambda run: json.load(open(run + "/metrics.json"))["rating_mae"]))' "${ratings[@]}")
  echo "rating model picked on the dev papers: $rating" >&2
  [[ -n $dev_eval ]] || dev_eval=$(cat "$LOGS/dev_eval.dir")
  rating_flags=(--rating_run "$rating" --rating_dev_run "$dev_eval" --rerank_by_rating "${RERANK_N:-4}")
fi

# shellcheck disable=SC2086
evalrun=$(stage 05_eval.py --config "$RECIPE/05_eval.yaml" --pairs_run "$pairs" --sft_run "$sft" \
  "${policy_flags[@]}" $decoding $reading "${rating_flags[@]}" "${EVAL_FLAGS[@]}")
"$PY" scripts/review_real_weights.py summary "$evalrun" "$SUMMARY_DIR" --sweep "${sweep[@]}"

echo
echo "reviewer on real weights finished in $(( $(date +%s) - start )) s; runs: $pairs $sft ${sweep[*]} ${ratings[*]:-} ${dev_eval:-} ${policies[*]:-} $evalrun"
echo "report: $(cd "$evalrun" && pwd)/report.md"
