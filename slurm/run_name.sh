#!/usr/bin/env bash
# Print, and reserve, the next free run name of a stage: <Mon><DD>_<Stage>_Run<N>, as the stages name
# their runs (common/runs.py), N one above the highest run directory or reservation of that stage
# and date. The reservation, RUNS_DIR/slurm/<name>.job, is created atomically (noclobber), so two
# chains submitted before either has started never pick the same name. A run that takes the name
# anyway (a manual run without --run_name) makes the job fail loudly: run directories are never shared.
#   slurm/run_name.sh SFT [RUNS_DIR]      # prints e.g. Nov30_SFT_Run3
set -euo pipefail
stage=${1:?usage: run_name.sh Pairs|SFT|Reward|GRPO|Eval [RUNS_DIR]}
runs_dir=${2:-runs}
mkdir -p "$runs_dir/slurm"
prefix="$(LC_ALL=C date +%b%d)_${stage}_Run"
n=0
for path in "$runs_dir/$prefix"* "$runs_dir/slurm/$prefix"*.job; do
  num=$(basename "$path" .job)
  num=${num#"$prefix"}
  # base 10: a run numbered 08 is eight, not a bad octal number
  if [[ $num =~ ^[0-9]+$ ]] && (( 10#$num > n )); then n=$(( 10#$num )); fi
done
while :; do
  n=$(( n + 1 ))
  name=$prefix$n
  if [[ ! -e $runs_dir/$name ]] && ( set -o noclobber; : > "$runs_dir/slurm/$name.job" ) 2>/dev/null; then
    echo "$name"
    exit 0
  fi
done
