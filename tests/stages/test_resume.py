"""Resuming outside Slurm: a tiny SFT run that is stopped (SIGUSR1/SIGTERM: checkpoint, exit 75) or
killed (SIGKILL: its last periodic checkpoint) continues with `--resume RUN_DIR` in the same run
directory and ends at the same optimiser step, with the same losses, as an uninterrupted run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, run_dir_of, run_in_process, run_stage

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)

STOP_EXIT_CODE = 75  # common.training.STOP_EXIT_CODE (not imported: that would load torch here)
# Enough steps (epochs x batches of the data) that a stop lands well before the end.
SFT = ["--config", "configs/tiny/02_train_sft.yaml", "--max_steps", "-1", "--num_train_epochs", "5",
       "--logging_steps", "1"]


def start_sft(runs: Path, pairs_run: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    log = runs.parent / f"{runs.name}.log"
    runs.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "02_train_sft.py", *SFT, "--runs_dir", str(runs),
                             "--pairs_run", str(pairs_run), *extra], cwd=REPO,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, log


def wait_for(condition, proc, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"gave up waiting (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def losses(metrics: dict) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in metrics["log_history"] if "loss" in h}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model, pairs_run) -> dict:
    runs = tmp_path_factory.mktemp("uninterrupted")
    proc = run_stage("02_train_sft.py", *SFT, "--runs_dir", runs, "--pairs_run", pairs_run, "--save_steps", 1000)
    return json.loads((run_dir_of(proc) / "metrics.json").read_text())


def stop(runs: Path, pairs_run: Path, sig: int, total_steps: int) -> tuple[Path, Path, int]:
    """Start a run, signal it once it trains; it must checkpoint and exit 75 without DONE."""
    proc, log = start_sft(runs, pairs_run, "--run_name", "stopped", "--save_steps", "1000")
    wait_for(lambda: "'loss'" in log.read_text(errors="replace"), proc, log)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == STOP_EXIT_CODE, log.read_text()[-3000:]
    run = runs / "stopped"
    assert not (run / "DONE").exists() and not (run / "metrics.json").exists()
    (checkpoint,) = (run / "checkpoints").glob("checkpoint-*")  # saved on the signal, not by save_steps
    stopped_at = int(checkpoint.name.split("-")[1])
    assert 0 < stopped_at < total_steps
    return run, checkpoint, stopped_at


def test_term_checkpoints_and_stops(tmp_path, pairs_run, uninterrupted):
    # TERM is what Slurm sends every process of a preempted or cancelled job.
    stop(tmp_path / "runs", pairs_run, signal.SIGTERM, uninterrupted["global_step"])


def test_stopped_run_resumes_to_the_same_step(tmp_path, pairs_run, uninterrupted):
    runs = tmp_path / "runs"
    run, checkpoint, stopped_at = stop(runs, pairs_run, signal.SIGUSR1, uninterrupted["global_step"])
    torn = run / "checkpoints" / "checkpoint-999"  # as a job killed while saving leaves one
    torn.mkdir()
    (torn / "trainer_state.json").write_text('{"global_step": 999, "log_hist')  # cut short

    resumed = run_stage("02_train_sft.py", *SFT, "--runs_dir", runs, "--pairs_run", pairs_run,
                        "--save_steps", 1000, "--resume", run)
    assert run_dir_of(resumed) == run
    assert sorted(p.name for p in runs.iterdir()) == ["stopped"]  # no new run directory
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(checkpoint)  # the incomplete checkpoint-999 is ignored
    assert metrics["global_step"] == uninterrupted["global_step"]
    # Optimiser, scheduler, data order and RNG come back with the checkpoint: the steps after the
    # stop have the losses of the uninterrupted run.
    after = {s: l for s, l in losses(metrics).items() if s > stopped_at + 1}
    assert after and after == pytest.approx({s: losses(uninterrupted)[s] for s in after}, rel=1e-3)
    # The run's numbers cover both segments, not just the part after the resume.
    assert metrics["train"]["n_segments"] == 2
    assert metrics["train"]["train_loss"] == pytest.approx(uninterrupted["train"]["train_loss"], rel=1e-3)
    manifest = json.loads((run / "manifest.json").read_text())
    assert [s["to_step"] for s in manifest["segments"]] == [stopped_at, uninterrupted["global_step"]]
    assert metrics["train"]["train_runtime"] == pytest.approx(sum(s["runtime_s"] for s in manifest["segments"]))


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path, pairs_run, uninterrupted):
    runs = tmp_path / "runs"
    proc, log = start_sft(runs, pairs_run, "--run_name", "killed", "--save_steps", "4")
    checkpoints = runs / "killed" / "checkpoints"
    wait_for(lambda: (checkpoints / "checkpoint-4" / "trainer_state.json").is_file(), proc, log)
    proc.kill()  # SIGKILL: no chance to save; the periodic checkpoints are what is left
    proc.wait()
    assert not (runs / "killed" / "DONE").exists()
    complete = [int(p.parent.name.split("-")[1]) for p in checkpoints.glob("checkpoint-*/trainer_state.json")]

    run_stage("02_train_sft.py", *SFT, "--runs_dir", runs, "--pairs_run", pairs_run, "--save_steps", 4,
              "--resume", runs / "killed")
    metrics = json.loads((runs / "killed" / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(checkpoints / f"checkpoint-{max(complete)}")
    assert metrics["global_step"] == uninterrupted["global_step"]
    assert sorted(p.name for p in runs.iterdir()) == ["killed"]


def test_finished_run_is_never_resumed(tmp_path, pairs_run):
    done = tmp_path / "done"
    done.mkdir()
    for name in ("config.yaml", "DONE"):
        (done / name).write_text("")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in done.iterdir())
    proc = run_stage("02_train_sft.py", *SFT, "--runs_dir", tmp_path, "--pairs_run", pairs_run, "--resume", done,
                     check=False)
    assert proc.returncode != 0 and "finished" in proc.stderr
    assert sorted((p.name, p.stat().st_mtime_ns) for p in done.iterdir()) == before


# --- resuming at the last step ----------------------------------------------------------------------

def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(run / "adapter" / "adapter_model.safetensors")


def test_a_run_killed_after_its_last_step_resumes_to_the_same_adapter(tmp_path, tiny_model, pairs_run):
    import shutil

    sft = ["--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs_run, "--runs_dir", tmp_path,
           "--lr_scheduler_type", "constant", "--max_steps", 3, "--save_steps", 2, "--lora_dropout", 0]
    done = run_in_process("02_train_sft.py", *sft, "--run_name", "uninterrupted")
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run_in_process("02_train_sft.py", *sft, "--run_name", "killed")
    assert killed.returncode == 0, killed.stderr[-3000:]
    run = run_dir_of(killed)
    assert (run / "checkpoints" / "checkpoint-3").is_dir()
    os.remove(run / "DONE")  # as a run killed while it saved its adapter leaves it
    shutil.rmtree(run / "adapter")
    resumed = run_in_process("02_train_sft.py", "--resume", run)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and max(h["step"] for h in metrics["log_history"]) == 3
    # The last step is trained again from checkpoint-2; a resumed step is not bitwise the uninterrupted
    # one (tests/stages/test_resume.py), but it is far closer than one more optimiser step (~learning_rate a weight).
    want, got = _adapter(run_dir_of(done)), _adapter(run)
    assert want.keys() == got.keys()
    assert sum(float((want[k] - got[k]).abs().mean()) for k in want) / len(want) < 2e-4
    segments = json.loads((run / "manifest.json").read_text())["segments"]
    assert [(s["from_step"], s["to_step"]) for s in segments] == [(0, 3), (2, 3)]
    assert all(s["patches"] is not None and s["backends"]["fast_paths"] is True for s in segments), segments
