"""The whole pipeline, all five stage scripts through their real command lines, on the tiny recipe."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import run_dir_of, run_stage


@pytest.fixture(scope="module")
def pipeline(tiny_model, pairs_run, tmp_path_factory) -> dict[str, Path]:
    runs = tmp_path_factory.mktemp("pipeline")
    common = ["--runs_dir", runs]
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                               "--pairs_run", pairs_run, "--report_to", "wandb", *common))
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, *common))
    grpo = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml",
                                "--sft_run", sft, "--reward_run", reward, *common))
    dpo = run_dir_of(run_stage("04_train_dpo.py", "--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", sft,
                               *common))
    proc = run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                     "--reward_run", reward, "--sft_run", sft, "--policy_runs", grpo, dpo, *common)
    return {"pairs": pairs_run, "sft": sft, "reward": reward, "grpo": grpo, "dpo": dpo, "eval": run_dir_of(proc),
            "eval_stdout": proc.stdout, "runs": runs}


def test_every_stage_finished_with_its_artifacts(pipeline):
    for key in ("pairs", "sft", "reward", "grpo", "dpo", "eval"):
        run = pipeline[key]
        for name in ("config.yaml", "manifest.json", "run.log", "metrics.json", "DONE"):
            assert (run / name).is_file(), f"{run} lacks {name}"
    for split in ("train", "dev", "test"):
        assert (pipeline["pairs"] / f"{split}.jsonl").stat().st_size > 0
    for key in ("sft", "reward", "grpo", "dpo"):
        assert (pipeline[key] / "adapter" / "adapter_model.safetensors").is_file()
    assert (pipeline["eval"] / "report.md").is_file()
    assert f"report: {pipeline['eval'] / 'report.md'}" in pipeline["eval_stdout"]


def test_run_directory_names_follow_the_contract(pipeline):
    import re
    for key, stage in (("pairs", "Pairs"), ("sft", "SFT"), ("reward", "Reward"), ("grpo", "GRPO"), ("dpo", "DPO"),
                       ("eval", "Eval")):
        assert re.fullmatch(rf"[A-Z][a-z]{{2}}\d{{2}}_{stage}_Run1", pipeline[key].name), pipeline[key].name


def test_manifests_record_inputs_base_and_environment(pipeline):
    grpo = json.loads((pipeline["grpo"] / "manifest.json").read_text())
    assert set(grpo["inputs"]) == {"sft_run", "reward_run"}
    for entry in grpo["inputs"].values():
        assert len(entry["sha256"]) == 64 and Path(entry["path"]).is_dir()
    sft = json.loads((pipeline["sft"] / "manifest.json").read_text())
    assert grpo["base"] == sft["base"] and grpo["base"]["lora_r"] == 64
    for key in ("argv", "overrides", "git", "seed", "packages", "host", "gpu", "slurm_job_id", "wandb_run_id"):
        assert key in grpo
    assert grpo["packages"]["trl"] and grpo["packages"]["bitsandbytes"]
    # the resolved config is written first and is loadable
    assert yaml.safe_load((pipeline["grpo"] / "config.yaml").read_text())["num_generations"] == 4


def test_wandb_runs_offline_inside_the_run_directory(pipeline):
    manifest = json.loads((pipeline["sft"] / "manifest.json").read_text())
    assert manifest["wandb_run_id"]
    offline = list((pipeline["sft"] / "wandb").glob("offline-run-*"))
    assert offline and manifest["wandb_run_id"] in offline[0].name


def test_eval_json_has_every_model_and_metric(pipeline):
    results = json.loads((pipeline["eval"] / "eval.json").read_text())
    assert set(results) == {"base", "sft", "grpo", "dpo"}  # GRPO and DPO on the same held-out premises
    for name, metrics in results.items():
        for key in ("bleu", "rougeL", "reward_mean", "win_rate_vs_base"):
            assert isinstance(metrics[key], float), (name, key)
        low, high = metrics["win_rate_vs_base_ci95"]
        assert 0.0 <= low <= metrics["win_rate_vs_base"] <= high <= 1.0
    assert results["base"]["win_rate_vs_base"] == 0.5
    report = (pipeline["eval"] / "report.md").read_text()
    assert "| grpo |" in report and "| dpo |" in report and "real reply" in report


def test_grpo_logs_reward_and_length_per_step(pipeline):
    metrics = json.loads((pipeline["grpo"] / "metrics.json").read_text())
    assert metrics["global_step"] == 2
    assert len(metrics["per_step"]) == 2
    for step in metrics["per_step"]:
        assert isinstance(step["reward_mean"], float) and step["reply_length_mean"] > 0


def test_reward_metrics_on_dev(pipeline):
    metrics = json.loads((pipeline["reward"] / "metrics.json").read_text())
    for key in ("accuracy", "mean_margin", "length_only_accuracy", "score_length_spearman"):
        assert key in metrics
    assert 0.0 <= metrics["accuracy"] <= 1.0


def test_mismatched_base_is_refused_naming_the_field(pipeline):
    proc = run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", pipeline["sft"],
                     "--reward_run", pipeline["reward"], "--lora_r", "8", "--runs_dir", pipeline["runs"], check=False)
    assert proc.returncode != 0
    assert "base mismatch" in proc.stderr and "'lora_r'" in proc.stderr


def test_unfinished_input_is_refused(pipeline, tmp_path):
    import shutil
    broken = tmp_path / "Nov30_SFT_Run9"
    shutil.copytree(pipeline["sft"], broken)
    (broken / "DONE").unlink()
    proc = run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", broken,
                     "--reward_run", pipeline["reward"], "--runs_dir", tmp_path / "runs", check=False)
    assert proc.returncode != 0 and "no DONE marker" in proc.stderr
