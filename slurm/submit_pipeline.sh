#!/usr/bin/env bash
# Submit the whole pipeline as a chain of Slurm jobs:
#   01 pairs -> 02 SFT, 03 reward (side by side) -> 04 GRPO or DPO -> 05 eval
#
#   slurm/submit_pipeline.sh [--recipe configs/llama3-8b] [--preference grpo|dpo] [--runs_dir runs]
#       [--sbatch "OPTS"] [--sbatch-NN "OPTS"] [--args "ARGS"] [--args-NN "ARGS"]
#
#   --recipe DIR      the stage configs (DIR/0N_<stage>.yaml); default configs/llama3-8b; the review
#                     task: configs/llama3-8b/review (with --preference dpo; it has no judge, no 03)
#   --preference P    stage 04: grpo (04_train_grpo, needs 03's judge) or dpo (04_train_dpo, from 02
#                     alone); default grpo. 03 is submitted when the recipe has 03_train_reward.yaml.
#   --runs_dir DIR    where the run directories go; default runs
#   --sbatch "OPTS"   extra sbatch options for every job (e.g. "--account=abc --partition=gpu");
#                     --sbatch-02 "OPTS" for one stage only (e.g. "--gpus-per-node=2 --time=8:00:00")
#   --args "ARGS"     extra stage arguments for every stage (e.g. "--report_to none");
#                     --args-01 "ARGS" for one stage only (e.g. "--data data/my.jsonl.gz")
# Values in OPTS/ARGS are split on spaces. sbatch also reads SBATCH_ACCOUNT, SBATCH_PARTITION etc.
#
# Every run name is fixed now (slurm/run_name.sh: the next free <Mon><DD>_<Stage>_Run<N>, reserved),
# so each job is given the run directories of its inputs, and a requeued job finds its own run.
# Each job starts only when its inputs' jobs succeeded (--dependency=afterok); when one fails, Slurm
# cancels every job after it (--kill-on-invalid-dep=yes) and the failed job's log says which.
# Job output: RUNS_DIR/slurm/<run name>-<job id>.log, copied into the run directory at the end.
set -euo pipefail

recipe=configs/llama3-8b runs_dir=runs preference=grpo
common_sbatch=() common_args=()
declare -A stage_sbatch=() stage_args=()
while (( $# )); do
  case $1 in
    --recipe) recipe=$2 ;;
    --preference) preference=$2 ;;
    --runs_dir) runs_dir=$2 ;;
    --sbatch) read -ra common_sbatch <<< "$2" ;;
    --args) read -ra common_args <<< "$2" ;;
    --sbatch-0[1-5]) stage_sbatch[${1#--sbatch-}]=$2 ;;
    --args-0[1-5]) stage_args[${1#--args-}]=$2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "submit_pipeline.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  (( $# >= 2 )) || { echo "submit_pipeline.sh: $1 needs a value" >&2; exit 2; }
  shift 2
done

root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$runs_dir"
runs_dir=$(cd "$runs_dir" && pwd)  # the jobs run in the repository root: make it absolute
cd "$root"
command -v sbatch >/dev/null || { echo "submit_pipeline.sh: sbatch not found: not on a Slurm login node?" >&2; exit 2; }
case $preference in
  grpo) stage04=04_train_grpo stage04_name=GRPO ;;
  dpo) stage04=04_train_dpo stage04_name=DPO ;;
  *) echo "submit_pipeline.sh: --preference must be grpo or dpo, got '$preference'" >&2; exit 2 ;;
esac
judge=0
[[ -f $recipe/03_train_reward.yaml ]] && judge=1
(( judge )) || [[ $preference == dpo ]] \
  || { echo "submit_pipeline.sh: --preference grpo needs $recipe/03_train_reward.yaml (its judge)" >&2; exit 2; }
for n in 01_build_pairs 02_train_sft $stage04 05_eval; do
  [[ -f $recipe/$n.yaml ]] || { echo "submit_pipeline.sh: $recipe/$n.yaml missing" >&2; exit 2; }
done

declare -A name job
for pair in 01:Pairs 02:SFT 03:Reward 04:$stage04_name 05:Eval; do
  name[${pair%%:*}]=$(slurm/run_name.sh "${pair#*:}" "$runs_dir")
done

submit() {  # submit NN SCRIPT DEPENDENCY STAGE_ARGS...: prints the job id
  local nn=$1 script=$2 dependency=$3
  shift 3
  local extra_sbatch=() extra_args=()
  read -ra extra_sbatch <<< "${stage_sbatch[$nn]:-}"
  read -ra extra_args <<< "${stage_args[$nn]:-}"
  local opts=(--parsable --job-name="${name[$nn]}" --output="$runs_dir/slurm/%x-%j.log"
              --chdir="$root" --export=ALL,PIPELINE_ROOT="$root" --requeue --open-mode=append
              --kill-on-invalid-dep=yes)
  [[ -n $dependency ]] && opts+=(--dependency="afterok:$dependency")
  local id
  id=$(sbatch "${opts[@]}" "${common_sbatch[@]}" "${extra_sbatch[@]}" "slurm/$script.sbatch" \
         --config "$recipe/$script.yaml" --runs_dir "$runs_dir" --run_name "${name[$nn]}" \
         "$@" "${common_args[@]}" "${extra_args[@]}")
  id=${id%%;*}  # --parsable prints "id" or "id;cluster"
  echo "$id" > "$runs_dir/slurm/${name[$nn]}.job"
  echo "$id"
}

r=$runs_dir
job[01]=$(submit 01 01_build_pairs "")
job[02]=$(submit 02 02_train_sft "${job[01]}" --pairs_run "$r/${name[01]}")
judge_args=() judge_dep=""
if (( judge )); then
  job[03]=$(submit 03 03_train_reward "${job[01]}" --pairs_run "$r/${name[01]}")
  judge_args=(--reward_run "$r/${name[03]}") judge_dep=":${job[03]}"
fi
if [[ $preference == grpo ]]; then
  job[04]=$(submit 04 04_train_grpo "${job[02]}$judge_dep" --sft_run "$r/${name[02]}" "${judge_args[@]}")
else
  job[04]=$(submit 04 04_train_dpo "${job[02]}" --sft_run "$r/${name[02]}")
fi
job[05]=$(submit 05 05_eval "${job[01]}:${job[02]}$judge_dep:${job[04]}" --pairs_run "$r/${name[01]}" \
          "${judge_args[@]}" --sft_run "$r/${name[02]}" --policy_runs "$r/${name[04]}")

stages=(01 02 03 04 05)
(( judge )) || stages=(01 02 04 05)
ids=()
for nn in "${stages[@]}"; do ids+=("${job[$nn]}"); done
echo "submitted the pipeline ($recipe, $preference) into $runs_dir:"
printf '  %-8s %s\n' job "run directory"
for nn in "${stages[@]}"; do printf '  %-8s %s\n' "${job[$nn]}" "${name[$nn]}"; done
echo "W&B group: ${name[01]} (every stage of this chain)"
echo "watch:  squeue -j $(IFS=,; echo "${ids[*]}")"
echo "logs:   $runs_dir/slurm/<run name>-<job>.log; report: $runs_dir/${name[05]}/report.md"
echo "jobs: ${ids[*]}"
