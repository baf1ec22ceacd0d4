"""The whole pipeline, all five stage scripts through their real command lines, on the tiny recipe."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import requires_two_gpus_on_a_gpu, run_dir_of, run_stage

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)


@pytest.fixture(scope="module")
def pipeline(tiny_model, pairs_run, tmp_path_factory) -> dict[str, Path]:
    runs = tmp_path_factory.mktemp("pipeline")
    common = ["--runs_dir", runs]
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                               "--pairs_run", pairs_run, "--report_to", "wandb", *common))
    # as the GPU recipes train it: padding-free micro-batches filled to a token budget
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, "--padding_free", "true", "--max_tokens_per_batch", "640",
                                  *common))
    grpo = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml",
                                "--sft_run", sft, "--reward_run", reward, *common))
    dpo = run_dir_of(run_stage("04_train_dpo.py", "--config", "configs/tiny/04_train_dpo.yaml", "--sft_run", sft,
                               *common))
    # A held-out judge: pointwise, trained on the dev posts (the policy trains on train, eval scores test).
    held_out = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                    "--pairs_run", pairs_run, "--judge_objective", "pointwise", "--train_split", "dev",
                                    "--audit_split", "test", "--run_name", "HeldOut_Judge", *common))
    proc = run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                     "--reward_run", reward, "--judge_runs", held_out, "--sft_run", sft, "--policy_runs", grpo, dpo,
                     *common)
    return {"pairs": pairs_run, "sft": sft, "reward": reward, "grpo": grpo, "dpo": dpo, "held_out": held_out,
            "eval": run_dir_of(proc), "eval_stdout": proc.stdout, "runs": runs}


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
    judges = results.pop("judges")
    assert set(results) == {"base", "sft", "grpo", "dpo"}  # GRPO and DPO on the same held-out premises
    assert set(judges) == {pipeline["reward"].name, pipeline["held_out"].name}
    for name, metrics in results.items():
        for key in ("bleu", "rougeL", "reward_mean", "win_rate_vs_base"):
            assert isinstance(metrics[key], float), (name, key)
        low, high = metrics["win_rate_vs_base_ci95"]
        assert 0.0 <= low <= metrics["win_rate_vs_base"] <= high <= 1.0
    assert results["base"]["win_rate_vs_base"] == 0.5
    report = (pipeline["eval"] / "report.md").read_text()
    assert "| grpo |" in report and "| dpo |" in report and "real reply" in report


def test_eval_with_two_judges_writes_both_sets_of_metrics(pipeline):
    results = json.loads((pipeline["eval"] / "eval.json").read_text())
    judges = results.pop("judges")
    training, held_out = pipeline["reward"].name, pipeline["held_out"].name
    assert judges[training]["role"] == "training" and judges[training]["objective"] == "pairwise"
    assert judges[held_out]["role"] == "held_out" and judges[held_out]["objective"] == "pointwise"
    assert judges[held_out]["train_split"] == "dev" and judges[held_out]["posts_shared_with_policy"] == 0
    for name, metrics in results.items():
        assert set(metrics["by_judge"]) == {training, held_out}
        for judge in (training, held_out):
            j = metrics["by_judge"][judge]
            low, high = j["win_rate_vs_base_ci95"]
            assert isinstance(j["reward_mean"], float) and 0 <= low <= j["win_rate_vs_base"] <= high <= 1
            assert 0 <= j["lc_win_rate_vs_base"] <= 1
        # the flat judge metrics stay the training judge's
        assert metrics["reward_mean"] == metrics["by_judge"][training]["reward_mean"]
    # the two judges score the same replies differently: they are different models
    assert results["base"]["by_judge"][training]["reward_mean"] != results["base"]["by_judge"][held_out]["reward_mean"]
    report = (pipeline["eval"] / "report.md").read_text()
    assert "## Judges" in report and f"**{held_out}**: pointwise" in report and f"**{training}**: pairwise" in report
    manifest = json.loads((pipeline["eval"] / "manifest.json").read_text())
    assert set(manifest["judges"]) == {training, held_out} and "judge_runs[0]" in manifest["inputs"]


def test_eval_refuses_a_judge_trained_on_the_premises_it_scores(pipeline):
    # the training judge trained on the train split's posts: as another judge of the train split's premises
    proc = run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pipeline["pairs"],
                     "--judge_runs", pipeline["reward"], "--split", "train", "--runs_dir", pipeline["runs"], check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --judge_runs {pipeline['reward']}: judge {pipeline['reward'].name} trained on 4 of "
                           f"the 4 premises it would score"), line
    # the same judge on the test premises is fine (it is checked before anything is generated)
    posts = set(json.loads((pipeline["reward"] / "train_posts.json").read_text())["posts"])
    test_posts = {json.loads(line)["group_id"] for line in (pipeline["pairs"] / "test.jsonl").read_text().splitlines()}
    assert posts and not posts & test_posts


def test_pointwise_judge_saves_reloads_and_scores_like_it_trained(pipeline):
    from common.data import load_split
    from common.rewards import RewardScorer
    held_out = pipeline["held_out"]
    metrics = json.loads((held_out / "metrics.json").read_text())
    assert metrics["judge_objective"] == "pointwise" and metrics["metrics_split"] == "test"
    assert metrics["n_train_pairs"] == 16 and metrics["global_step"] == 3  # 16 dev pairs: 32 replies
    assert json.loads((held_out / "train_posts.json").read_text())["split"] == "dev"
    saved = [json.loads(line) for line in (held_out / "test_scores.jsonl").read_text().splitlines()]
    test = load_split(pipeline["pairs"], "test")[: len(saved)]
    scorer = RewardScorer.from_run(held_out)
    again = scorer.score([r["prompt"] for r in test], [r["rejected"] for r in test])
    assert again == [s["rejected_score"] for s in saved]  # bit-identical, as the pairwise judge (test_model.py)
    # both objectives get the same audit on the same kind of held-out pairs
    pairwise = json.loads((pipeline["reward"] / "judge_audit.json").read_text())
    pointwise = json.loads((held_out / "judge_audit.json").read_text())
    assert pointwise["split"] == "test" and set(pointwise) == set(pairwise)
    assert set(pointwise["probes"]) == set(pairwise["probes"]) and pointwise["verdict"]["text"]
    assert "test_accuracy" in pointwise["baselines"]["bag_of_words"]


def test_grpo_logs_reward_and_length_per_step(pipeline):
    metrics = json.loads((pipeline["grpo"] / "metrics.json").read_text())
    assert metrics["global_step"] == 2
    assert len(metrics["per_step"]) == 2
    for step in metrics["per_step"]:
        assert isinstance(step["reward_mean"], float) and step["reply_length_mean"] > 0


def test_reward_metrics_on_dev(pipeline):
    patches = json.loads((pipeline["reward"] / "manifest.json").read_text())["patches"]
    assert patches[0] == "padding_free" and "batch_by_tokens" in patches and "unmask_right_padding" not in patches
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


@requires_two_gpus_on_a_gpu
def test_grpo_runs_data_parallel_in_two_processes(pipeline):
    """GRPO on two processes (torchrun; gloo on the CPU, NCCL on GPUs): each samples its own rollouts with
    the static decoder, scores them with its judge and trains on them with the shared prompt, the LoRA
    gradients all-reduced. One run directory, written by rank 0; a step samples twice the completions
    of one process."""
    import subprocess
    import sys

    from conftest import REPO
    args = ["--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", pipeline["sft"], "--reward_run",
            pipeline["reward"], "--runs_dir", pipeline["runs"], "--run_name", "Two_Process_GRPO"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "04_train_grpo.py", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=600)
    # a rank that fails first is the cause; torchrun's own report names only the rank it then stopped
    first_failure = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank1]"))[:3000]
    assert proc.returncode == 0, first_failure + proc.stdout[-2000:] + proc.stderr[-3000:]
    run = pipeline["runs"] / "Two_Process_GRPO"
    assert (run / "DONE").is_file() and (run / "adapter" / "adapter_model.safetensors").is_file()
    assert not list(pipeline["runs"].glob("Two_Process_GRPO_*"))  # one directory for both processes
    two = json.loads((run / "manifest.json").read_text())
    one = json.loads((pipeline["grpo"] / "manifest.json").read_text())
    assert two["processes"] == 2 and one["processes"] == 1 and "group_in_one_sequence" in two["patches"]
    first_step = [json.loads((r / "metrics.json").read_text())["log_history"][0] for r in (pipeline["grpo"], run)]
    # num_tokens counts the prompt and reply tokens of the step's completions, over all processes
    assert first_step[1]["num_tokens"] > 1.5 * first_step[0]["num_tokens"]


def test_grpo_whose_groups_all_tie_is_not_done(pipeline):
    """A reward blind to the reply: each premise's four replies get the same reward, and no advantage is
    ever non-zero; the adapter would be the SFT one, so the run must not say DONE. (A near-zero temperature
    does not make the four replies the same: the tiny model's bf16 logits often tie at their top, and the
    sampler draws among tied tokens, so on a GPU the replies, and then the judge's rewards, differed.)"""
    proc = run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", pipeline["sft"],
                     "--reward_run", pipeline["reward"], "--reward_funcs", "tests.test_reward_terms:blind_to_the_reply",
                     "--runs_dir", pipeline["runs"], "--run_name", "Tied_GRPO", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "equal rewards at every step" in proc.stderr.strip().splitlines()[-1]
    run = pipeline["runs"] / "Tied_GRPO"
    assert not (run / "DONE").exists()
    assert {e["frac_reward_zero_std"] for e in json.loads((run / "metrics.json").read_text())["log_history"]
            if "frac_reward_zero_std" in e} == {1.0}
