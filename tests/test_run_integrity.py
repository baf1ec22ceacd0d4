"""A run directory never lies: resume is bound to its run, inputs are checked for what they are, a
run that a later stage cannot use is never DONE, and every bad setting is one line before anything
heavy happens."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, error_line, run_dir_of, run_in_process, run_stage
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from common.cli import parse_config
from common.config import (
    ConfigError,
    EvalConfig,
    GRPOStageConfig,
    PairsConfig,
    RewardStageConfig,
    SFTStageConfig,
    load_run_config,
)
from common.runs import Run, RunError, create_run_dir
from common.training import last_checkpoint
from common.watch import WatchCallback

SFT_YAML = "configs/tiny/02_train_sft.yaml"


def _no_traceback_one_error(proc):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def _finished(path, stage, pairs_run=None, base=None, task="cmv", artifacts=None):
    """A finished run directory as a stage leaves it (manifest, config, artifacts, DONE)."""
    path.mkdir(parents=True)
    for rel, text in (artifacts or {}).items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    from common.provenance import artifact_digests
    manifest = {"run_name": path.name, "stage": stage, "base": base, "task": task,
                "pairs_run": str(pairs_run.resolve()) if pairs_run else None, "artifacts": artifact_digests(path)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "DONE").write_text("")
    return path


BASE = {"model": "m", "lora_r": 64}


# --- resume is bound to its run ---------------------------------------------------------------------

@pytest.fixture()
def unfinished_sft(tmp_path, tiny_model, pairs_run):
    """An SFT run killed before its first checkpoint: a config.yaml and a manifest, nothing else."""
    config, overrides = parse_config(SFTStageConfig, ["--config", SFT_YAML, "--pairs_run", str(pairs_run),
                                                      "--runs_dir", str(tmp_path / "runs"), "--max_steps", "4",
                                                      "--run_name", "killed"])
    from common.model import fingerprint
    Run("SFT", config, overrides, inputs={"pairs_run": pairs_run}, argv=["test"], base=fingerprint(config))
    return tmp_path / "runs" / "killed"


@pytest.mark.stage
def test_resume_alone_takes_the_runs_own_settings_and_refuses_a_different_one(unfinished_sft):
    proc = run_stage("02_train_sft.py", "--resume", unfinished_sft, "--max_steps", "7", check=False)
    line = _no_traceback_one_error(proc)
    assert "field 'max_steps' is 7 (command line) but 4 in the run's config.yaml" in line
    assert not (unfinished_sft / "DONE").exists()

    done = run_stage("02_train_sft.py", "--resume", unfinished_sft)  # nothing else: the run knows its inputs
    assert run_dir_of(done) == unfinished_sft
    metrics = json.loads((unfinished_sft / "metrics.json").read_text())
    assert metrics["global_step"] == 4  # the run's max_steps, not the recipe's epochs
    assert yaml.safe_load((unfinished_sft / "config.yaml").read_text())["max_steps"] == 4


@pytest.mark.stage
def test_resume_refuses_another_stages_directory(tmp_path, pairs_run):
    deleted = tmp_path / "deleted.jsonl"  # a Pairs run that failed: 0 usable pairs
    deleted.write_text(json.dumps({"op_id": "t3_x", "op_title": "CMV: a view", "positive_reply": "[deleted]",
                                   "negative_reply": "A reply."}) + "\n")
    failed = run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--data", deleted,
                       "--runs_dir", tmp_path / "runs", check=False)
    _no_traceback_one_error(failed)
    (pairs_dir,) = (tmp_path / "runs").iterdir()
    before = sorted(p.name for p in pairs_dir.iterdir())
    proc = run_stage("02_train_sft.py", "--config", SFT_YAML, "--pairs_run", pairs_run, "--resume", pairs_dir,
                     check=False)
    assert "that is a Pairs run; this script continues SFT runs only" in _no_traceback_one_error(proc)
    assert sorted(p.name for p in pairs_dir.iterdir()) == before and not (pairs_dir / "DONE").exists()


@pytest.mark.stage
def test_a_failure_after_the_run_directory_exists_is_in_its_log(tmp_path):
    deleted = tmp_path / "deleted.jsonl"  # well-formed rows, every one unusable: a run with 0 pairs
    row = {"op_id": "t3_x", "op_title": "CMV: a view", "op_text": "Some text.", "positive_reply": "[deleted]",
           "negative_reply": "A reply."}
    deleted.write_text("".join(json.dumps({**row, "op_id": f"t3_{i}"}) + "\n" for i in range(5)))
    proc = run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--data", deleted,
                     "--runs_dir", tmp_path / "runs", check=False)
    line = _no_traceback_one_error(proc)
    assert line.startswith("error: no pairs in the train and test split(s) of 5 input rows")
    (run,) = (tmp_path / "runs").iterdir()
    assert line in (run / "run.log").read_text() and not (run / "DONE").exists()


# --- inputs are checked for what they are -------------------------------------------------------------

@pytest.mark.stage
def test_an_input_of_the_wrong_stage_is_refused_before_a_directory_is_made(tmp_path):
    pairs = _finished(tmp_path / "P", "Pairs", artifacts={"train.jsonl": "{}\n"})
    pairs_manifest = json.loads((pairs / "manifest.json").read_text())
    reward = _finished(tmp_path / "R", "Reward", pairs_run=pairs, base=BASE, artifacts={"adapter/a": "x"})
    config, _ = parse_config(GRPOStageConfig, ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", str(reward),
                                               "--reward_run", str(reward), "--runs_dir", str(tmp_path / "runs")])
    with pytest.raises(RunError, match="--sft_run .*: that is a Reward run; --sft_run takes a SFT run"):
        Run("GRPO", config, {}, inputs={"sft_run": reward, "reward_run": reward}, argv=["test"])
    assert not (tmp_path / "runs").exists()
    assert pairs_manifest["stage"] == "Pairs"


@pytest.mark.stage
def test_eval_refuses_a_reward_run_that_is_a_pairs_run_before_generating(tmp_path, pairs_run):
    proc = run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                     "--reward_run", pairs_run, "--runs_dir", tmp_path / "runs", check=False)
    assert "that is a Pairs run; --reward_run takes a Reward run" in _no_traceback_one_error(proc)
    assert not (tmp_path / "runs").exists()


@pytest.mark.stage
def test_inputs_from_different_pairs_runs_are_refused_naming_them(tmp_path):
    p1 = _finished(tmp_path / "P1", "Pairs", artifacts={"test.jsonl": "{}\n"})
    p2 = _finished(tmp_path / "P2", "Pairs", artifacts={"test.jsonl": "{}\n"})
    sft = _finished(tmp_path / "S", "SFT", pairs_run=p1, base=BASE, artifacts={"adapter/a": "x"})
    reward = _finished(tmp_path / "R", "Reward", pairs_run=p2, base=BASE, artifacts={"adapter/a": "y"})
    config, _ = parse_config(EvalConfig, ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", str(p2),
                                          "--reward_run", str(reward), "--sft_run", str(sft),
                                          "--runs_dir", str(tmp_path / "runs")])
    with pytest.raises(RunError, match=r"different pairs runs .*--sft_run .*S descends from .*P1"):
        Run("Eval", config, {}, inputs={"pairs_run": p2, "reward_run": reward, "sft_run": sft}, argv=["test"])
    # The same chain on one pairs run is accepted, and the run records its lineage.
    reward1 = _finished(tmp_path / "R1", "Reward", pairs_run=p1, base=BASE, artifacts={"adapter/a": "z"})
    run = Run("Eval", config, {}, inputs={"pairs_run": p1, "reward_run": reward1, "sft_run": sft}, argv=["test"])
    assert run.manifest["pairs_run"] == str(p1.resolve()) and run.manifest["task"] == "cmv"


@pytest.mark.stage
def test_another_judge_may_come_from_another_pairs_run_but_not_another_task_or_base(tmp_path):
    p1 = _finished(tmp_path / "P1", "Pairs", artifacts={"test.jsonl": "{}\n"})
    p2 = _finished(tmp_path / "P2", "Pairs", artifacts={"test.jsonl": "{}\n"})
    judge = _finished(tmp_path / "J", "Reward", pairs_run=p2, base=BASE, artifacts={"adapter/a": "j"})
    config, _ = parse_config(EvalConfig, ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", str(p1),
                                          "--judge_runs", str(judge), "--runs_dir", str(tmp_path / "runs")])
    run = Run("Eval", config, {}, inputs={"pairs_run": p1, "judge_runs[0]": judge}, argv=["test"])
    assert run.manifest["pairs_run"] == str(p1.resolve())  # the eval's lineage is its own pairs run's
    with pytest.raises(RunError, match="different pairs runs"):  # as the training judge it is refused
        Run("Eval", config, {}, inputs={"pairs_run": p1, "reward_run": judge}, argv=["test"])
    review = _finished(tmp_path / "JR", "Reward", pairs_run=p2, base=BASE, task="review", artifacts={"adapter/a": "r"})
    with pytest.raises(RunError, match="different tasks"):
        Run("Eval", config, {}, inputs={"pairs_run": p1, "judge_runs[0]": review}, argv=["test"])
    other_base = _finished(tmp_path / "JB", "Reward", pairs_run=p2, base={**BASE, "lora_r": 8},
                           artifacts={"adapter/a": "b"})
    with pytest.raises(RunError, match="base mismatch with input 'judge_runs\\[0\\]'.*'lora_r'"):
        Run("Eval", config, {}, inputs={"pairs_run": p1, "judge_runs[0]": other_base}, argv=["test"], base=BASE)
    with pytest.raises(RunError, match="--judge_runs\\[0\\] .*that is a Pairs run"):
        Run("Eval", config, {}, inputs={"pairs_run": p1, "judge_runs[0]": p2}, argv=["test"])


@pytest.mark.stage
def test_a_rating_model_of_another_base_is_taken_but_not_an_sft_run_of_one(tmp_path):
    # A rating model loads on its own base (SmolLM2's beside a Qwen writer); the writer's runs share one.
    pairs = _finished(tmp_path / "P", "Pairs", task="review", artifacts={"test.jsonl": "{}\n"})
    sft = _finished(tmp_path / "S", "SFT", pairs_run=pairs, base=BASE, task="review", artifacts={"adapter/a": "s"})
    other = {**BASE, "model": "another family"}
    rating = _finished(tmp_path / "R", "Reward", pairs_run=pairs, base=other, task="review", artifacts={"adapter/a": "r"})
    config, _ = parse_config(EvalConfig, ["--config", "configs/tiny/review/05_eval.yaml", "--pairs_run", str(pairs),
                                          "--runs_dir", str(tmp_path / "runs")])
    run = Run("Eval", config, {}, inputs={"pairs_run": pairs, "sft_run": sft, "rating_run": rating},
              argv=["test"], base=BASE)
    assert run.manifest["inputs"]["rating_run"]["base"] == other  # recorded as it is
    sft_other = _finished(tmp_path / "S2", "SFT", pairs_run=pairs, base=other, task="review", artifacts={"adapter/a": "t"})
    with pytest.raises(RunError, match="base mismatch with input 'sft_run'.*'model'"):
        Run("Eval", config, {}, inputs={"pairs_run": pairs, "sft_run": sft_other, "rating_run": rating},
            argv=["test"], base=BASE)


@pytest.mark.stage
def test_base_lock_refuses_a_model_run_without_a_base(tmp_path):
    pairs = _finished(tmp_path / "P", "Pairs", artifacts={"train.jsonl": "{}\n"})
    sft = _finished(tmp_path / "S", "SFT", pairs_run=pairs, base=None, artifacts={"adapter/a": "x"})
    config, _ = parse_config(GRPOStageConfig, ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", str(sft),
                                               "--reward_run", "unused", "--runs_dir", str(tmp_path / "runs")])
    with pytest.raises(RunError, match="records no base model"):
        Run("GRPO", config, {}, inputs={"sft_run": sft}, argv=["test"], base=BASE)
    assert not (tmp_path / "runs").exists()


@pytest.mark.stage
@pytest.mark.parametrize("change", ["delete", "edit"])
def test_an_input_whose_artifact_changed_after_it_finished_is_refused(tmp_path, change):
    pairs = _finished(tmp_path / "P", "Pairs", artifacts={"train.jsonl": "{}\n"})
    sft = _finished(tmp_path / "S", "SFT", pairs_run=pairs, base=BASE,
                    artifacts={"adapter/adapter_model.safetensors": "weights", "adapter/adapter_config.json": "{}"})
    target = sft / "adapter" / "adapter_model.safetensors"
    target.unlink() if change == "delete" else target.write_text("other weights")
    config, _ = parse_config(GRPOStageConfig, ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", str(sft),
                                               "--reward_run", "unused", "--runs_dir", str(tmp_path / "runs")])
    message = "is missing adapter/adapter_model.safetensors" if change == "delete" else "changed after the run finished"
    with pytest.raises(RunError, match=message):
        Run("GRPO", config, {}, inputs={"sft_run": sft}, argv=["test"])


@pytest.mark.stage
def test_a_finished_stage_records_its_artifacts_and_a_later_stage_reads_its_config_typed(tmp_path, pairs_run):
    manifest = json.loads((pairs_run / "manifest.json").read_text())
    assert {"train.jsonl", "dev.jsonl", "test.jsonl", "metrics.json", "config.yaml"} <= set(manifest["artifacts"])
    assert manifest["pairs_run"] == str(pairs_run.resolve()) and manifest["task"] == "cmv"
    config = load_run_config(pairs_run)
    assert isinstance(config, PairsConfig) and config.length_balance == "match_ratio"


# --- bad settings: one line, before any model or run directory -----------------------------------------

@pytest.mark.parametrize("cls, argv, message", [
    (PairsConfig, ["--length_balance", "sometimes"], "field 'length_balance' expects one of 'match_ratio', 'none'"),
    (PairsConfig, ["--task", "chess"], "field 'task' expects one of"),
    (PairsConfig, ["--dev_fraction", "1.5"], "field 'dev_fraction' must be below 1"),
    (PairsConfig, ["--dev_fraction", "-0.5"], "field 'dev_fraction' must be at least 0"),
    (PairsConfig, ["--dev_fraction", "0.5", "--test_fraction", "0.5"], "dev_fraction + test_fraction must be below 1"),
    (PairsConfig, ["--max_length_ratio", "0.5"], "field 'max_length_ratio' must be at least 1"),
    (PairsConfig, ["--run_name", "../x"], "field 'run_name' must be one path component"),
    (PairsConfig, ["--run_name", "/tmp/x"], "field 'run_name' must be one path component"),
    (PairsConfig, ["--run_name", "sub/dir"], "field 'run_name' must be one path component"),
    (PairsConfig, ["--report_to", "wandB"], "field 'report_to' expects one of 'wandb', 'none'"),
    (RewardStageConfig, ["--pairs_run", "p", "--judge_backbone", "bert"], "field 'judge_backbone' expects one of"),
    (RewardStageConfig, ["--pairs_run", "p", "--judge_model_name_or_path", "pkg:os/x"], "not a known model package"),
    (RewardStageConfig, ["--pairs_run", "p", "--judge_objective", "listwise"], "field 'judge_objective' expects one of"),
    (RewardStageConfig, ["--pairs_run", "p", "--train_split", "dev"], "field 'audit_split' must differ from train_split"),
    (EvalConfig, ["--pairs_run", "p", "--reward_run", "a/R1", "--judge_runs", "b/R1"], "its own run name"),
    (GRPOStageConfig, ["--sft_run", "s", "--reward_run", "r", "--rollout_backend", "vllm"], "'rollout_backend' expects"),
    (GRPOStageConfig, ["--sft_run", "s", "--reward_run", "r", "--guard_max_length_ratio", "0.5"], "must be above 1"),
    (SFTStageConfig, ["--pairs_run", "p", "--per_device_train_batch_size", "0"], "must be at least 1"),
    (SFTStageConfig, ["--pairs_run", "p", "--max_steps", "-5"], "field 'max_steps' must be at least -1"),
    (SFTStageConfig, ["--pairs_run", "p", "--max_steps", "0"], "field 'max_steps' must be -1"),
    (SFTStageConfig, [], "--pairs_run is required"),
])
def test_a_bad_setting_is_a_config_error_naming_the_field(cls, argv, message):
    recipe = {PairsConfig: "01_build_pairs", SFTStageConfig: "02_train_sft", RewardStageConfig: "03_train_reward",
              GRPOStageConfig: "04_train_grpo", EvalConfig: "05_eval"}[cls]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
        parse_config(cls, ["--config", f"configs/tiny/{recipe}.yaml", *argv])


@pytest.mark.stage
@pytest.mark.parametrize("script, argv, message", [
    ("01_build_pairs.py", ["--config", "configs/tiny/01_build_pairs.yaml", "--length_balance", "x"], "length_balance"),
    ("02_train_sft.py", ["--pairs_run", "runs/x"], "--config is required"),
    ("01_build_pairs.py", ["--config", "configs/tiny/01_build_pairs.yaml", "--data", "data/cmv"], "is a directory"),
])
def test_bad_command_lines_end_in_one_error_line_and_make_nothing(tmp_path, script, argv, message):
    proc = run_stage(script, *argv, "--runs_dir", tmp_path / "runs", check=False)
    line = _no_traceback_one_error(proc)
    assert line.startswith("error: ") and message in line
    assert not (tmp_path / "runs").exists()


def test_runs_dir_that_is_a_file_is_a_run_error(tmp_path):
    (tmp_path / "runs").write_text("")
    with pytest.raises(RunError, match="cannot create a run directory in --runs_dir"):
        create_run_dir(tmp_path / "runs", "SFT")


@pytest.mark.stage
def test_every_stage_has_help_listing_its_fields():
    for script, field in (("01_build_pairs.py", "--length_balance"), ("02_train_sft.py", "--max_length"),
                          ("03_train_reward.py", "--judge_backbone"), ("04_train_grpo.py", "--guard_max_length_ratio"),
                          ("05_eval.py", "--max_premises")):
        proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"  {field} (" in proc.stdout and "--seed (int; default 42)" in proc.stdout


# --- checkpoints and the GRPO guard across restarts -----------------------------------------------------

def test_a_torn_trainer_state_falls_back_to_the_previous_checkpoint(tmp_path):
    for step, state in ((4, '{"global_step": 4}'), (8, '{"global_step": 8, "log_hi')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-12").mkdir()  # no trainer_state.json at all
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")


def test_the_length_guard_keeps_its_reference_across_a_restart(tmp_path):
    from transformers import TrainerControl
    state = tmp_path / "guard.json"
    first = WatchCallback(max_length_ratio=2.0, patience=2, state_path=state)
    first.on_log(None, None, TrainerControl(), logs={"rewards/watch_reply_words/mean": 10.0})  # the first batch
    assert json.loads(state.read_text())["reference_words"] == 10
    restarted = WatchCallback(max_length_ratio=2.0, patience=2, state_path=state)
    for _ in range(2):
        restarted.on_log(None, None, TrainerControl(), logs={"rewards/watch_reply_words/mean": 50.0})
    assert restarted.tripped and "averaged 10.0 words" in restarted.tripped


@pytest.fixture(scope="module")
def stopped_sft(tmp_path_factory, tiny_model, pairs_run):
    """An SFT run with a checkpoint of step 2 of 3, as a stopped run leaves it (no DONE)."""
    runs = tmp_path_factory.mktemp("stopped")
    run = run_dir_of(run_stage("02_train_sft.py", "--config", SFT_YAML, "--pairs_run", pairs_run, "--runs_dir", runs))
    (run / "DONE").unlink()
    return run


@pytest.mark.stage
@pytest.mark.parametrize("damage", [
    lambda p: p.write_bytes(__import__("pickle").dumps(__import__("collections").OrderedDict(a=print))),
    lambda p: p.write_bytes(__import__("pickle").dumps({"os": __import__("os").getcwd})),
    lambda p: p.write_bytes(p.read_bytes()[:40])])
def test_a_damaged_checkpoint_on_resume_is_one_error_line(tmp_path, stopped_sft, damage):
    import shutil
    run = tmp_path / stopped_sft.name
    shutil.copytree(stopped_sft, run)
    (run / "run.lock").unlink(missing_ok=True)
    damage(run / "checkpoints" / "checkpoint-2" / "rng_state.pth")
    line = _no_traceback_one_error(run_stage("02_train_sft.py", "--resume", run, check=False))
    assert line.startswith(f"error: checkpoint {run / 'checkpoints' / 'checkpoint-2'} is damaged"), line


@pytest.mark.stage
@pytest.mark.parametrize("block", ["lock_is_a_folder", "read_only"])
def test_resume_where_the_lock_cannot_be_opened_is_one_error_line(tmp_path, stopped_sft, block):
    import os
    import shutil
    run = tmp_path / stopped_sft.name
    shutil.copytree(stopped_sft, run)
    (run / "run.lock").unlink(missing_ok=True)
    if block == "lock_is_a_folder":
        (run / "run.lock").mkdir()
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes through a read-only mode; the folder case takes the same path")
        run.chmod(0o500)
    try:
        line = _no_traceback_one_error(run_stage("02_train_sft.py", "--resume", run, check=False))
    finally:
        run.chmod(0o700)
    assert line.startswith(f"error: cannot open {run / 'run.lock'} to lock the run"), line


# --- settings refused before a run exists ------------------------------------------------------------

def _run(script: str, *args) -> subprocess.CompletedProcess:
    return run_in_process(script, *args)


_error = error_line


SFT = ["--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", "runs/not_needed"]


@pytest.mark.stage
@pytest.mark.parametrize("script, args", [
    ("02_train_sft.py", [*SFT, "--learning_rate", "inf"]),
    ("02_train_sft.py", [*SFT, "--learning_rate", ".nan"]),
    ("04_train_dpo.py", ["--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", "s", "--beta", "inf"]),
], ids=["lr_inf", "lr_nan", "dpo_beta_inf"])
def test_a_non_finite_setting_is_refused_before_a_run_exists(tmp_path, script, args):
    line = _error(_run(script, *args, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert "must be a finite number" in line, line


@pytest.mark.stage
def test_infinite_epochs_are_refused_before_a_run_exists(tmp_path):
    line = _error(_run("02_train_sft.py", *SFT, "--num_train_epochs", "inf", "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line.startswith("error: command line: field 'num_train_epochs' must be a finite number"), line


@pytest.mark.stage
def test_an_empty_config_or_a_missing_model_is_one_error_line(tmp_path, tiny_model):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    line = _error(_run("02_train_sft.py", "--config", empty, "--pairs_run", "p", "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line == f"error: {empty}: the config is empty; give a recipe (configs/<recipe>/0N_<stage>.yaml)"
    line = _error(_run("02_train_sft.py", *SFT, "--model_name_or_path", tmp_path / "no_such_model",
                       "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert line.startswith(f"error: field 'model_name_or_path': no usable model at '{tmp_path / 'no_such_model'}'")


def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ndata: *a{levels - 1}\n"


@pytest.mark.stage
def test_a_yaml_alias_bomb_is_refused_at_once_in_a_short_line(tmp_path):
    config = tmp_path / "bomb.yaml"
    config.write_text(_alias_bomb())
    started = time.time()
    line = _error(_run("01_build_pairs.py", "--config", config, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert time.time() - started < 10 and len(line) < 300, (time.time() - started, len(line))
    assert line.startswith(f"error: {config}:2: YAML aliases (*name) are not allowed"), line


@pytest.mark.stage
def test_a_key_given_twice_in_a_config_is_refused(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text("task: cmv\nseed: 1\nreport_to: none\nseed: 2\n")
    line = _error(_run("01_build_pairs.py", "--config", config, "--runs_dir", tmp_path / "runs"), tmp_path / "runs")
    assert line == f"error: {config}:4: field 'seed' is given twice", line


@pytest.mark.stage
@pytest.mark.parametrize("script, args, field", [
    ("05_eval.py", ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", "p", "--max_new_tokens", 10**8],
     "max_new_tokens"),
    ("04_train_dpo.py", ["--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", "s", "--max_new_tokens", 8192],
     "max_new_tokens"),
    ("04_train_grpo.py", ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", "s", "--reward_run", "r",
                          "--max_completion_length", 10**8], "max_completion_length"),
], ids=["eval", "dpo", "grpo"])
def test_generated_tokens_beyond_the_models_context_are_refused(tmp_path, tiny_model, script, args, field):
    runs = tmp_path / "runs"
    line = _error(run_in_process(script, *args, "--runs_dir", runs), runs)
    assert line.startswith(f"error: field '{field}' ("), line
    assert line.endswith("must fit the model's context of 8192 tokens (max_position_embeddings in "
                         ".cache/models/tiny-llama3/config.json)"), line


# --- input runs -------------------------------------------------------------------------------------

@pytest.mark.stage
def test_a_corrupt_manifest_in_an_input_or_resumed_run_is_one_error_line(tmp_path, tiny_model, pairs_run):
    broken = tmp_path / "Dec01_Pairs_Run9"
    shutil.copytree(pairs_run, broken)
    (broken / "manifest.json").write_text('{"stage": "Pairs", "artif')
    line = _error(_run("02_train_sft.py", *SFT[:2], "--pairs_run", broken, "--runs_dir", tmp_path / "runs"),
                  tmp_path / "runs")
    assert line.startswith(f"error: {broken / 'manifest.json'}: not a readable manifest"), line
    os.remove(broken / "DONE")
    line = _error(_run("01_build_pairs.py", "--resume", broken))
    assert line.startswith(f"error: --resume {broken}: {broken / 'manifest.json'}: not a readable manifest"), line


@pytest.mark.stage
def test_an_input_run_without_an_artifact_list_is_refused(tmp_path, pairs_run):
    from common.runs import check_input
    copy = tmp_path / "Dec01_Pairs_Run9"
    shutil.copytree(pairs_run, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["artifacts"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "test.jsonl").write_text("")
    with pytest.raises(RunError, match=f"input run {copy} records no artifacts"):
        check_input("pairs_run", copy)


# --- run directories: the inputs and the lock on resume ---------------------------------------------

PAIRS_01 = "configs/tiny/01_build_pairs.yaml"


def _new_run(tmp_path: Path, *argv, base=None):
    """A run directory as a stage creates it (settings, inputs, lock), without training anything."""
    from common.config import SFTStageConfig
    from common.runs import Run
    new = [] if "--resume" in argv else ["--config", "configs/tiny/02_train_sft.yaml", "--runs_dir", str(tmp_path / "runs")]
    config, overrides = parse_config(SFTStageConfig, [*new, *map(str, argv)])
    run = Run("SFT", config, overrides, inputs={"pairs_run": config.pairs_run}, base=base)
    logging.getLogger().removeHandler(run._handler)
    run._handler.close()
    return run


def _end(run) -> None:
    """The process that ran `run` ends: its lock on the run directory goes with it."""
    lock = getattr(run, "_lock", None)
    if lock is not None:
        lock.close()


def _pairs(runs: Path, seed: int) -> Path:
    proc = run_in_process("01_build_pairs.py", "--config", PAIRS_01, "--runs_dir", runs, "--run_name", "pairs",
                          "--seed", seed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir_of(proc)


@pytest.mark.stage
def test_a_resumed_run_refuses_an_input_rebuilt_since_it_started(tmp_path):
    import shutil

    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft")
    recorded = (first.dir / "manifest.json").read_text()
    _end(first)
    shutil.rmtree(pairs)
    _pairs(tmp_path / "pairs", 2)  # rebuilt under the same path: finished, unchanged since, but other pairs
    with pytest.raises(RunError, match=rf"--resume {first.dir}: input --pairs_run {pairs} is not what the run "
                                       r"started with \(sha256 "):
        _new_run(tmp_path, "--resume", first.dir)
    assert (first.dir / "manifest.json").read_text() == recorded  # the record of the first segment is kept


@pytest.mark.stage
def test_a_resumed_run_refuses_another_base(tmp_path):
    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft", base={"weights_sha256": "a"})
    _end(first)
    with pytest.raises(RunError, match="the base model is not the one the run started with"):
        _new_run(tmp_path, "--resume", first.dir, base={"weights_sha256": "b"})


@pytest.mark.stage
def test_one_run_directory_is_run_by_one_process_at_a_time(tmp_path):
    from common.runs import RunError
    pairs = _pairs(tmp_path / "pairs", 1)
    first = _new_run(tmp_path, "--pairs_run", pairs, "--run_name", "sft")
    with pytest.raises(RunError, match=rf"run directory {first.dir} is in use by another process"):
        _new_run(tmp_path, "--resume", first.dir)
    _end(first)  # the first process ended
    again = _new_run(tmp_path, "--resume", first.dir)
    assert len(again.manifest["resumed"]) == 1
    _end(again)
    assert "run.lock" not in json.dumps(json.loads((pairs / "manifest.json").read_text())["artifacts"])


# --- property-based: hostile settings ---------------------------------------------------------------

_CONFIG_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from([".inf", "-.inf", ".nan", ".NaN", "1e400", "-1e400", "1.0e+400", "nan", "inf"]),
    st.integers(-10**30, 10**30).map(str), st.integers(19, 5000).map(lambda n: "9" * n),
    st.integers(1, 6).map(lambda n: "&x " + "[" * n + "1" + "]" * n),
    st.just("[" * 3000 + "]" * 3000))
_FIELDS = ("learning_rate", "num_train_epochs", "warmup_ratio", "lora_dropout", "max_steps", "lora_r", "seed",
           "max_length", "window_overlap", "save_steps")


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(_FIELDS), value=_CONFIG_VALUES, where=st.sampled_from(["yaml", "command_line", "twice"]),
       aliases=st.integers(0, 6))
def test_hostile_settings_are_a_checked_config_or_one_short_error(tmp_path, field, value, where, aliases):
    from common.cli import parse_config
    from common.config import INT_LIMIT, ConfigError, SFTStageConfig
    base = Path("configs/tiny/review/02_train_sft.yaml").read_text()
    text = base if where == "command_line" else base + f"\n{field}: {value}\n"
    if where == "twice":
        text += f"{field}: {value}\n"
    if aliases:
        text = text.replace("seed: 42", "") + _alias_bomb(aliases).replace("data:", "seed:")
    config_path = tmp_path / "c.yaml"
    config_path.write_text(text)
    argv = ["--config", str(config_path), "--pairs_run", "p"]
    argv += ["--" + field, value] if where == "command_line" else []
    started = time.time()
    try:
        config, _ = parse_config(SFTStageConfig, argv)
    except ConfigError as err:
        assert len(str(err)) < 500 and time.time() - started < 10, str(err)[:500]
        event("error: " + str(err).split(": ")[-2][-30:])
        return
    event("config")
    assert where == "command_line" or (where == "yaml" and not aliases)
    for name, got in vars(config).items():
        if isinstance(got, float):
            assert got == got and abs(got) != float("inf"), (name, got)
        if isinstance(got, int):
            assert abs(got) <= INT_LIMIT, name
