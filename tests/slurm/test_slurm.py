"""The Slurm wrappers against a real single-node Slurm (munged, slurmctld, slurmd on this machine;
.ci/slurm_up.sh starts them): the tiny pipeline submitted as a chain, a failing stage and the jobs
after it, and a training stage signalled before its time limit (checkpoint, requeue, resume).
Skipped when there is no sbatch or no controller answers. No part of Slurm is mocked."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# CPU-only jobs on the test node. USR1 would come 60 s before a 10-minute limit: never, here.
SBATCH_TEST = ["--gpus-per-node=0", "--cpus-per-task=1", "--mem=1G", "--time=10", "--signal=B:USR1@60"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _no_slurm_reason() -> str | None:
    if not shutil.which("sbatch"):
        return "sbatch is not on PATH (as root, .ci/slurm_up.sh installs and starts a test Slurm)"
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol ping failed: {err}"
    if " is UP" not in out:
        return "no Slurm controller answers `scontrol ping` (as root, .ci/slurm_up.sh starts one)"
    return None


NO_SLURM = _no_slurm_reason()
needs_slurm = pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))


def job_info(job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_jobs(job_ids: list[str], logs: Path, timeout: float = 400) -> dict[str, dict]:
    deadline = time.time() + timeout
    while True:
        infos = {j: job_info(j) for j in job_ids}
        if all(i.get("JobState") in ENDED for i in infos.values()):
            return infos
        if time.time() > deadline:
            subprocess.run(["scancel", *job_ids])
            pytest.fail(f"jobs not finished after {timeout} s: "
                        f"{ {j: i.get('JobState') for j, i in infos.items()} }\n{tail_logs(logs)}")
        time.sleep(1)


def tail_logs(logs: Path, n: int = 3000) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in sorted(logs.glob("*.log")))


def run_dirs(runs: Path) -> dict[str, Path]:
    """Stage -> run directory (the name's middle part), asserting one per stage."""
    dirs = [p for p in runs.iterdir() if p.is_dir() and p.name != "slurm"]
    stages = [p.name.split("_")[1] for p in dirs]
    assert len(stages) == len(set(stages)), f"more than one run of a stage: {sorted(p.name for p in dirs)}"
    return dict(zip(stages, dirs))


def submit_pipeline(runs: Path, *extra: str, recipe: str = "configs/tiny") -> list[str]:
    proc = subprocess.run(["bash", "slurm/submit_pipeline.sh", "--recipe", recipe, "--runs_dir", str(runs),
                           "--sbatch", " ".join(SBATCH_TEST), *extra], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [line for line in proc.stdout.splitlines() if line.startswith("jobs: ")]
    assert jobs, proc.stdout
    return jobs[0].split()[1:]


@pytest.mark.stage
@needs_slurm
def test_pipeline_chain_finishes_every_run(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    jobs = submit_pipeline(runs)
    infos = wait_jobs(jobs, runs / "slurm")
    states = {j: i["JobState"] for j, i in infos.items()}
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{tail_logs(runs / 'slurm')}"

    dirs = run_dirs(runs)
    assert sorted(dirs) == ["Eval", "GRPO", "Pairs", "Reward", "SFT"]
    for stage, job in zip(["Pairs", "SFT", "Reward", "GRPO", "Eval"], jobs):
        run = dirs[stage]
        assert (run / "DONE").is_file(), stage
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["slurm_job_id"] == job
        assert manifest["wandb_group"] == dirs["Pairs"].name  # one group per chain
        assert (run / f"slurm-{job}.log").is_file()  # the job's log, in the run directory
    # Each stage was given the run directories of its inputs from this chain.
    grpo = json.loads((dirs["GRPO"] / "manifest.json").read_text())["inputs"]
    assert Path(grpo["sft_run"]["path"]) == dirs["SFT"].resolve()
    assert Path(grpo["reward_run"]["path"]) == dirs["Reward"].resolve()
    assert (dirs["Eval"] / "report.md").is_file()


@pytest.mark.stage
@needs_slurm
def test_review_chain_with_dpo_finishes_every_run(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    jobs = submit_pipeline(runs, "--preference", "dpo", recipe="configs/tiny/review")
    infos = wait_jobs(jobs, runs / "slurm")
    states = {j: i["JobState"] for j, i in infos.items()}
    assert set(states.values()) == {"COMPLETED"}, f"{states}\n{tail_logs(runs / 'slurm')}"
    dirs = run_dirs(runs)
    assert sorted(dirs) == ["DPO", "Eval", "Pairs", "SFT"]  # the review task has no judge
    results = json.loads((dirs["Eval"] / "eval.json").read_text())
    assert {"base", "sft", "dpo", "baseline_constant", "baseline_human"} <= set(results)


@pytest.mark.stage
@needs_slurm
def test_failed_stage_cancels_the_jobs_after_it(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    # Stage 03 fails (a bad value); 02 does not depend on it; 04 and 05 do.
    jobs = submit_pipeline(runs, "--args-03", "--max_steps not-a-number")
    infos = wait_jobs(jobs, runs / "slurm")
    states = [infos[j]["JobState"] for j in jobs]
    assert states == ["COMPLETED", "COMPLETED", "FAILED", "CANCELLED", "CANCELLED"], \
        f"{states}\n{tail_logs(runs / 'slurm')}"
    assert infos[jobs[3]]["Reason"] == infos[jobs[4]]["Reason"] == "DependencyNeverSatisfied"
    assert sorted(run_dirs(runs)) == ["Pairs", "SFT"]  # 04 and 05 never ran
    log = next((runs / "slurm").glob(f"*-{jobs[2]}.log")).read_text()
    assert "stage FAILED" in log and "max_steps" in log
    assert jobs[3] in log  # it says which jobs are cancelled


@pytest.mark.stage
@needs_slurm
def test_signal_checkpoints_requeues_and_resumes(tmp_path, tiny_model, pairs_run):
    runs = tmp_path / "runs"
    name = subprocess.run(["bash", "slurm/run_name.sh", "SFT", str(runs)], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    logs = runs / "slurm"
    # Steps come from the data (epochs x batches), so resuming must skip what was done; enough of
    # them that the signal lands well before the end (about 0.2-1 s a step on 2 CPU cores).
    epochs = 10
    proc = subprocess.run(
        ["sbatch", "--parsable", *SBATCH_TEST, f"--job-name={name}", f"--output={logs}/%x-%j.log",
         "slurm/02_train_sft.sbatch", "--config", "configs/tiny/02_train_sft.yaml", "--runs_dir", str(runs),
         "--run_name", name, "--pairs_run", str(pairs_run), "--max_steps", "-1", "--num_train_epochs", str(epochs),
         "--save_steps", "1000", "--logging_steps", "1"],
        cwd=REPO, capture_output=True, text=True, check=True)
    job = proc.stdout.strip().split(";")[0]
    log = logs / f"{name}-{job}.log"

    # Signal the batch shell as the time limit would (--signal=B:USR1@N), once training has begun.
    deadline = time.time() + 180
    while not (log.is_file() and "'loss'" in log.read_text(errors="replace")):
        assert job_info(job).get("JobState") in {"PENDING", "RUNNING", "CONFIGURING"}, tail_logs(logs)
        assert time.time() < deadline, tail_logs(logs)
        time.sleep(0.3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)

    info = wait_jobs([job], logs)[job]
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert info["Restarts"] == "1", text[-4000:]
    assert "requeueing job" in text and "stopped on request at step" in text

    run = runs / name
    assert sorted(run_dirs(runs)) == ["SFT"]  # the same run directory, no new one
    metrics = json.loads((run / "metrics.json").read_text())
    uninterrupted = epochs * math.ceil(metrics["n_train_examples"] / 4)  # per_device_train_batch_size 4
    assert metrics["global_step"] == uninterrupted
    stopped_at = int(Path(metrics["resumed_from"]).name.split("-")[1])
    assert 0 < stopped_at < uninterrupted
    assert Path(metrics["resumed_from"]).parent == run / "checkpoints"
    assert [h["step"] for h in metrics["log_history"] if "loss" in h][-1] == uninterrupted
    resumed = json.loads((run / "manifest.json").read_text())["resumed"]
    assert [r["slurm_job_id"] for r in resumed] == [job]


def stage_sh(*args: str) -> subprocess.CompletedProcess:
    """slurm/stage.sh outside Slurm: its checks run before anything is launched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(["bash", "slurm/stage.sh", "02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                           *args], cwd=REPO, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.stage
def test_wrapper_checks_before_launching(tmp_path, pairs_run):
    proc = stage_sh("--runs_dir", str(tmp_path), "--pairs_run", str(pairs_run))
    assert proc.returncode == 2 and "give --run_name" in proc.stderr
    unfinished = tmp_path / "Nov30_Pairs_Run9"
    unfinished.mkdir()
    proc = stage_sh("--runs_dir", str(tmp_path), "--run_name", "x", "--pairs_run", str(unfinished))
    assert proc.returncode == 2 and "not a finished run" in proc.stderr
    taken = tmp_path / "Nov30_SFT_Run1"
    taken.mkdir()
    proc = stage_sh("--runs_dir", str(tmp_path), "--run_name", taken.name, "--pairs_run", str(pairs_run))
    assert proc.returncode == 2 and "another run has that name" in proc.stderr
    (taken / "DONE").write_text("")
    proc = stage_sh("--runs_dir", str(tmp_path), "--resume", str(taken), "--pairs_run", str(pairs_run))
    assert proc.returncode == 0 and "already DONE; nothing to do" in proc.stdout


@pytest.mark.stage
@pytest.mark.parametrize("name", ["../../../x/y", "../escape", "a/b", "/abs/path", ".."])
def test_wrapper_refuses_a_run_name_that_leaves_the_runs_dir_before_touching_the_disk(tmp_path, pairs_run, name):
    runs = tmp_path / "deep" / "er" / "runs"
    runs.mkdir(parents=True)
    proc = stage_sh("--runs_dir", str(runs), "--run_name", name, "--pairs_run", str(pairs_run))
    assert proc.returncode == 2 and "must be one path component" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == \
        [Path("deep"), Path("deep/er"), Path("deep/er/runs")]


@pytest.mark.parametrize("taken", [["08"], ["09", "3"], ["010"], ["7", "08", "19"]])
def test_run_name_counts_in_base_ten(tmp_path, taken):
    import datetime
    prefix = datetime.date.today().strftime("%b%d") + "_SFT_Run"
    for n in taken:
        (tmp_path / f"{prefix}{n}").mkdir()
    proc = subprocess.run(["bash", "slurm/run_name.sh", "SFT", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "LC_ALL": "C"})
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    assert proc.stdout.strip() == f"{prefix}{max(int(n) for n in taken) + 1}"


# --- the stage wrapper ------------------------------------------------------------------------------

def test_stage_sh_passes_list_fields_of_several_words(tmp_path):
    fake = tmp_path / "python"  # stands in for the launcher: records the arguments it is given
    fake.write_text('#!/usr/bin/env bash\ncase $1 in -c) exit 0 ;; -V) echo fake; exit 0 ;; esac\n'
                    'printf "%s\\n" "$@" > "$ARGS_OUT"\n')
    fake.chmod(0o755)
    done = [tmp_path / name for name in ("A", "B")]
    for run in done:
        run.mkdir()
        (run / "DONE").write_text("")
    env = {**os.environ, "PYTHON": str(fake), "ARGS_OUT": str(tmp_path / "args")}
    env.pop("SLURM_JOB_ID", None)

    def stage(*args):
        return subprocess.run(["bash", "slurm/stage.sh", "05_eval.py", "--config", "configs/tiny/05_eval.yaml",
                               *map(str, args), "--runs_dir", tmp_path / "runs", "--run_name", "E1"],
                              cwd=REPO, env=env, capture_output=True, text=True)
    stage("--policy_runs", *done, "--seed", 3)
    args = (tmp_path / "args").read_text().splitlines()
    at = args.index("--policy_runs")
    assert args[at:at + 5] == ["--policy_runs", *map(str, done), "--seed", "3"], args
    proc = stage("--judge_runs", done[0], tmp_path / "unfinished")
    assert proc.returncode != 0 and f"input --judge_runs {tmp_path / 'unfinished'} is not a finished run" in proc.stderr
