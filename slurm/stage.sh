#!/usr/bin/env bash
# The body of every slurm/0N_*.sbatch: checks, a header, the launch, checkpoint-and-requeue.
#
#   sbatch slurm/02_train_sft.sbatch --config configs/llama3-8b/02_train_sft.yaml \
#       --run_name Nov30_SFT_Run3 --pairs_run runs/Nov30_Pairs_Run1 [--field value ...]
#
# (slurm/submit_pipeline.sh writes these for the whole chain.) The arguments are the stage's own.
# - Run directory: --run_name NAME (under --runs_dir, default runs) or --resume DIR is required, so
#   that a requeued job finds its own run: on a restart (SLURM_RESTART_COUNT set) an unfinished run
#   directory is continued with --resume, a finished (DONE) one is left alone.
# - Time limit: `--signal=B:USR1@N` sends USR1 to this shell N s before the limit. A training stage
#   (02, 03, 04) is told through the stop file ($PIPELINE_STOP_FILE) to save a checkpoint at its next
#   optimiser step and exit without DONE; stages 01 and 05 have no checkpoints and are just stopped.
#   Then this script requeues the job, which resumes the same run directory.
# - Launch: `accelerate launch` on every node through srun, GPUS_PER_NODE processes per node
#   (default: the GPUs Slurm gave the job, at least 1); configs/accelerate/single_gpu.yaml for one
#   process, multi_gpu.yaml for more, or $ACCELERATE_CONFIG.
# - Environment: module/conda-agnostic. $PYTHON, else .venv/bin/python, else python3 on PATH.
# - Logs: the stage writes run.log in its run directory; this job's whole output (every attempt,
#   --open-mode=append) is copied there as slurm-<jobid>.log when the job ends or requeues.
set -euo pipefail

say() { echo "[stage.sh $(date +%H:%M:%S)] $*"; }
die() { echo "[stage.sh] error: $*" >&2; exit 2; }

root=${PIPELINE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$root" || die "cannot cd to $root"
script=${1:?usage: stage.sh 0N_stage.py [--field value ...]}
shift
[[ -f $script && -f common/runs.py ]] \
  || die "no $script in $root: submit from the repository root, or set PIPELINE_ROOT"
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3 || true); fi
fi
[[ -n $PYTHON ]] && "$PYTHON" -c 'import accelerate, common.runs' 2>/dev/null \
  || die "python '${PYTHON}' cannot import accelerate and the pipeline: activate your environment or set PYTHON"

# The arguments this script needs to know; everything is passed on to the stage except
# --run_name/--resume, which are decided below.
# A list field takes every word up to the next --field (--data a.jsonl b.jsonl, --policy_runs A B).
args=() runs_dir=runs run_name="" resume="" config=""
while (( $# )); do
  key=$1; shift
  [[ $key == --* ]] || die "expected --field, got '$key'"
  if [[ $key == --*=* ]]; then values=("${key#*=}"); key=${key%%=*}
  else
    values=()
    while (( $# )) && [[ $1 != --* ]]; do values+=("$1"); shift; done
    (( ${#values[@]} )) || die "$key needs a value"
  fi
  value=${values[0]}
  case $key in
    --run_name) run_name=$value; continue ;;
    --resume) resume=$value; continue ;;
    --runs_dir) runs_dir=$value ;;
    --config) config=$value ;;
    --*_run|--*_runs)
      for v in "${values[@]}"; do
        [[ $v == null || -f $v/DONE ]] \
          || die "input $key $v is not a finished run (no DONE): its stage failed or has not run"
      done ;;
  esac
  args+=("$key" "${values[@]}")
done
[[ -z $config || -f $config ]] || die "--config $config: no such file"

# A run name is one path component, checked before anything touches the disk (the stage checks it
# again, but only after this script has made the stop file's folder beside the run directory).
if [[ -n $run_name ]]; then
  [[ $run_name != */* && $run_name != . && $run_name != .. && $run_name != *\\* && $run_name != *[[:cntrl:]]* ]] \
    || die "--run_name '$run_name' must be one path component (no '/', '..' or absolute path)"
fi

# Which run directory, and new or continued.
if [[ -n $resume ]]; then run_dir=${resume%/}
elif [[ -n $run_name ]]; then run_dir=$runs_dir/$run_name
else die "give --run_name NAME (slurm/run_name.sh STAGE prints a free one) or --resume DIR: a requeued job must find its own run directory"
fi
restarts=${SLURM_RESTART_COUNT:-0}
if [[ -f $run_dir/DONE ]]; then
  if [[ -n $resume || $restarts -gt 0 ]]; then say "$run_dir is already DONE; nothing to do"; exit 0; fi
  die "$run_dir exists and is finished; pick another --run_name"
elif [[ -d $run_dir ]]; then
  [[ -n $resume || $restarts -gt 0 ]] \
    || die "$run_dir exists but this job has not run before: another run has that name; pick another --run_name"
  mode=resume; args+=(--resume "$run_dir")
else
  [[ -z $resume ]] || die "--resume $run_dir: no such run directory"
  mode=new; args+=(--run_name "$run_name")
fi

# Training stages checkpoint on request; the others are simply stopped and run again.
case $(basename "$script") in 02_*|03_*|04_*) checkpoints=1 ;; *) checkpoints=0 ;; esac
mkdir -p "$(dirname "$run_dir")/slurm"  # beside the run directory: shared by the nodes as it is
export PIPELINE_STOP_FILE=$(dirname "$run_dir")/slurm/stop-${SLURM_JOB_ID:-$$}
rm -f "$PIPELINE_STOP_FILE"  # a stale one from an earlier attempt would stop this one at once

# accelerate launch: one launcher per node, started by srun; machine rank from SLURM_NODEID.
nnodes=${SLURM_NNODES:-1}
per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
(( per_node >= 1 )) || per_node=1  # a CPU-only job: one process
nproc=$(( nnodes * per_node ))
if (( nproc > 1 )); then default_config=configs/accelerate/multi_gpu.yaml
else default_config=configs/accelerate/single_gpu.yaml; fi
accelerate_config=${ACCELERATE_CONFIG:-$default_config}
[[ -f $accelerate_config ]] || die "ACCELERATE_CONFIG $accelerate_config: no such file"
master=localhost
[[ -n ${SLURM_JOB_NODELIST:-} ]] && master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-$$} % 20000 ))}
launch=(--config_file "$accelerate_config" --num_machines "$nnodes" --num_processes "$nproc"
        --main_process_ip "$master" --main_process_port "$port" "$script" "${args[@]}")
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  # Each node's launcher takes its machine rank from its own SLURM_NODEID. srun does not pass the
  # job's --cpus-per-task on to the step in Slurm 22.05-23.02: say it again.
  cmd=(srun --nodes="$nnodes" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" --kill-on-bad-exit=1
       bash -c 'exec "$0" -m accelerate.commands.launch --machine_rank "$SLURM_NODEID" "$@"' "$PYTHON" "${launch[@]}")
else
  cmd=("$PYTHON" -m accelerate.commands.launch --machine_rank 0 "${launch[@]}")
fi

dirty=$(git status --porcelain 2>/dev/null | grep -q . && echo " (dirty)" || true)
echo "================================================================================"
say "$script: job ${SLURM_JOB_ID:-none} '${SLURM_JOB_NAME:-}' attempt $(( restarts + 1 )) on ${SLURM_JOB_NODELIST:-$(hostname)}"
say "run directory $run_dir ($mode); $nnodes node(s) x $per_node process(es), $accelerate_config"
say "repo $root at $(git rev-parse --short HEAD 2>/dev/null || echo '?')$dirty; $("$PYTHON" -V 2>&1) ($PYTHON)"
say "command: ${cmd[*]}"
echo "================================================================================"

copy_log() {  # this job's output file, into the run directory once that exists
  [[ -n ${SLURM_JOB_ID:-} && -d $run_dir ]] || return 0
  local out
  out=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'StdOut=[^ ]*' | cut -d= -f2-) || true
  [[ -n $out && -f $out ]] && cp "$out" "$run_dir/slurm-$SLURM_JOB_ID.log" || true
}

stop=0
on_usr1() {
  stop=1
  if (( checkpoints )); then
    say "USR1 (time limit near, or scancel --signal=USR1): asking the stage to save a checkpoint and stop"
    : > "$PIPELINE_STOP_FILE"
  else
    say "USR1 (time limit near, or scancel --signal=USR1): no checkpoints in this stage; stopping it to run it again"
    kill -TERM "$pid" 2>/dev/null || true
  fi
}
on_term() {  # preemption or scancel: Slurm TERMs every process; a training stage saves if it has time
  say "TERM: the job is being preempted or cancelled"
  : > "$PIPELINE_STOP_FILE"
}
trap on_usr1 USR1
trap on_term TERM

# In the background, so that the traps run at once instead of when the stage ends.
"${cmd[@]}" &
pid=$!
while :; do
  rc=0
  wait "$pid" || rc=$?
  kill -0 "$pid" 2>/dev/null || break  # the wait returned because the stage ended, not for a trap
done
rm -f "$PIPELINE_STOP_FILE"

if [[ -f $run_dir/DONE ]]; then
  say "finished: $run_dir (exit $rc)"
  copy_log
  exit "$rc"
fi
if (( stop )) && [[ -n ${SLURM_JOB_ID:-} ]]; then
  say "stopped before the time limit (exit $rc), not DONE: requeueing job $SLURM_JOB_ID to continue $run_dir"
  copy_log
  scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue failed: resubmit with --resume $run_dir"
  exit 0
fi
say "stage FAILED (exit $rc): $run_dir is not DONE"
if [[ -n ${SLURM_JOB_ID:-} ]]; then
  dependents=$(squeue -h -o '%i %j %E' 2>/dev/null | grep -E "after(ok|any|notok)?:${SLURM_JOB_ID}([^0-9]|$)" | cut -d' ' -f1,2 || true)
  if [[ -n $dependents ]]; then
    say "Slurm cancels the jobs that wait for this one (--kill-on-invalid-dep=yes), and theirs:"
    echo "$dependents" | sed 's/^/    /'
  fi
fi
copy_log
exit "$(( rc == 0 ? 1 : rc ))"
