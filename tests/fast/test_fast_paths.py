"""`fast_paths: false`, one switch to plain TRL and transformers, on the tiny recipe: every stage
takes it, it sets every fast field to its plain value, the losses agree with the fast paths where the
maths is the same (SFT, the reward model, DPO), and the manifests name the backends that ran."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_dir_of, run_stage

from common.cli import parse_config
from common.config import PLAIN_PATHS, STAGE_CONFIGS, DPOStageConfig, GRPOStageConfig, load_run_config
from common.fast.decode_step import nf4_dequantizer

NF4_TOLERANCE = 3e-2  # the same maths through other kernels, in bf16 compute on a 4-bit base


def _losses(run) -> list[float]:
    """Every logged training loss: the first step's, and the steps after an update on each path."""
    return [entry["loss"] for entry in json.loads((run / "metrics.json").read_text())["log_history"] if "loss" in entry]


def _backends(run) -> dict:
    return json.loads((run / "manifest.json").read_text())["backends"]


@pytest.mark.stage
@pytest.mark.parametrize("script", ["01_build_pairs.py", "02_train_sft.py", "03_train_reward.py", "04_train_grpo.py",
                                    "04_train_dpo.py", "05_eval.py"])
def test_every_stage_lists_fast_paths_in_its_help(script):
    proc = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "  --fast_paths (bool; default true)" in proc.stdout


def test_fast_paths_false_sets_every_fast_field_to_its_plain_value():
    grpo = GRPOStageConfig(sft_run="s", reward_run="r", fast_paths=False, rollout_weights="bf16", group_in_one_sequence=True,
                           liger_kernel=True, per_device_train_batch_size=4)
    assert (grpo.rollout_backend, grpo.rollout_weights, grpo.group_in_one_sequence, grpo.liger_kernel) == ("hf", "nf4", False,
                                                                                                   False)
    dpo = DPOStageConfig(sft_run="s", fast_paths=False, max_tokens_per_batch=4096, generation_weights="bf16")
    assert (dpo.max_tokens_per_batch, dpo.generation_weights, dpo.pair_in_one_sequence) == (0, "nf4", False)
    for cls in set(STAGE_CONFIGS.values()):  # every plain value is one the field accepts
        fields = cls.__dataclass_fields__
        assert all(name not in fields or isinstance(value, (bool, int, str)) for name, value in PLAIN_PATHS.items())


@pytest.fixture(scope="module")
def runs(tiny_model, pairs_run, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fast_paths")
    common = ["--pairs_run", pairs_run, "--runs_dir", out]
    made = {}
    for fast in ("true", "false"):
        made[f"sft_{fast}"] = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml",
                                                   *common, "--fast_paths", fast, "--memory_levers", "fit"))
        # fast: the reward model padding-free, a pair's replies sharing their prompt; plain: TRL's rows
        made[f"reward_{fast}"] = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                                      *common, "--padding_free", "true", "--fast_paths", fast))
    for fast in ("true", "false"):
        made[f"dpo_{fast}"] = run_dir_of(run_stage("04_train_dpo.py", "--config", "configs/tiny/04_train_dpo.yaml",
                                                   "--sft_run", made["sft_true"], "--runs_dir", out,
                                                   "--fast_paths", fast))
    for fast in ("true", "false"):
        made[f"grpo_{fast}"] = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml",
                                                    "--sft_run", made["sft_true"], "--reward_run", made["reward_true"],
                                                    "--runs_dir", out, "--fast_paths", fast))
        made[f"eval_{fast}"] = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run",
                                                    pairs_run, "--reward_run", made["reward_true"], "--sft_run",
                                                    made["sft_true"], "--policy_runs", made[f"grpo_{fast}"],
                                                    "--runs_dir", out, "--fast_paths", fast))
    return made


@pytest.mark.stage
@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_plain_and_fast_paths_give_the_same_loss(runs, stage):
    fast, plain = _losses(runs[f"{stage}_true"]), _losses(runs[f"{stage}_false"])
    assert len(fast) >= 2 and plain == pytest.approx(fast, rel=NF4_TOLERANCE), (stage, fast, plain)
    assert _backends(runs[f"{stage}_true"])["fast_paths"] is True
    assert _backends(runs[f"{stage}_false"])["fast_paths"] is False


@pytest.mark.stage
def test_manifests_name_the_backends(runs):
    assert "padding_free" in _backends(runs["reward_true"])["patches"]
    assert _backends(runs["reward_false"])["patches"] == [] and _backends(runs["reward_false"])["judge_scoring"] == "padded"
    assert "pair_in_one_sequence" in _backends(runs["dpo_true"])["patches"] and "pair_in_one_sequence" not in _backends(
        runs["dpo_false"])["patches"]
    assert "unmask_right_padding" in _backends(runs["sft_true"])["patches"] and _backends(runs["sft_false"])["patches"] == []
    grpo = _backends(runs["grpo_false"])
    assert (grpo["decoder"], grpo["judge_scoring"], grpo["patches"]) == ("trl_generate", "padded", [])
    grpo = _backends(runs["grpo_true"])
    dequantizer = nf4_dequantizer("cuda" if torch.cuda.is_available() else "cpu")  # Triton's on a GPU
    assert (grpo["decoder"], grpo["decoder_weights"], grpo["decoder_attention"], grpo["judge_scoring"]) == \
        ("static", f"nf4_{dequantizer}", "sdpa", "packed")  # sampled rollouts: SDPA's faster attention
    assert "group_in_one_sequence" in grpo["patches"] and grpo["decoder_fallbacks"] == []  # no graph on the CPU
    evaluation = _backends(runs["eval_false"])
    assert evaluation["decoder"] == "hf_generate" and set(evaluation["judge_scoring"].values()) == {"padded"}
    evaluation = _backends(runs["eval_true"])
    assert evaluation["decoder"] == "static" and set(evaluation["judge_scoring"].values()) == {"packed"}
    assert evaluation["decoder_fallbacks"] == []
    assert all((runs[f"{stage}_{fast}"] / "DONE").is_file() for stage in ("grpo", "eval") for fast in ("true", "false"))


@pytest.mark.stage
def test_manifests_say_which_memory_levers_ran(runs):
    """memory_levers fit plans on a GPU and says so; on the CPU the levers stay as written, with the reason; plain
    paths never plan (fast_paths false sets memory_levers as_set)."""
    def plan(run):
        return json.loads((run / "manifest.json").read_text())["memory_plan"]
    fit = plan(runs["sft_true"])
    if torch.cuda.is_available():
        assert fit["levers"] == "fit" and fit["plan"] and fit["estimated_peak_gib"]["keep_all"] > 0
        ran = load_run_config(runs["sft_true"])  # config.yaml says the levers the plan set
        assert all(getattr(ran, lever) == fit[lever] for lever in ("gradient_checkpointing", "layers_not_checkpointed",
                                                                   "offload_activations", "offload_keep_gib"))
    else:
        assert fit["levers"] == "as_set" and "CPU" in fit["why"]
    assert all(plan(runs[f"{stage}_false"]) == {"levers": "as_set"} for stage in ("sft", "reward", "dpo", "grpo"))


@pytest.mark.stage
@pytest.mark.parametrize("stage", ["grpo", "eval"])
def test_plain_and_fast_paths_both_finish_grpo_and_eval(runs, stage):
    """Sampling differs by path (the static decoder draws its own noise), so GRPO's losses and eval's replies
    are compared only in kind: both paths train and score every premise."""
    if stage == "grpo":
        fast, plain = _losses(runs["grpo_true"]), _losses(runs["grpo_false"])
        assert len(fast) == len(plain) >= 2
    else:
        fast, plain = (json.loads((runs[f"eval_{f}"] / "eval.json").read_text()) for f in ("true", "false"))
        assert fast.keys() == plain.keys()


# --- an asked-for value that fast_paths: false replaces ----------------------------------------------

def test_fast_paths_false_says_which_asked_for_value_it_replaced(tmp_path):
    from common.config import SFTStageConfig
    from common.runs import Run
    config, overrides = parse_config(SFTStageConfig, [
        "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", "p", "--runs_dir", str(tmp_path),
        "--fast_paths", "false", "--mlp_chunk_tokens", "64", "--liger_kernel", "false"])
    assert config.mlp_chunk_tokens == 0
    run = Run("SFT", config, overrides)
    logging.getLogger().removeHandler(run._handler)
    run._handler.close()
    warned = [line for line in (run.dir / "run.log").read_text().splitlines() if "is not used" in line]
    assert len(warned) == 1 and warned[0].endswith("--mlp_chunk_tokens 64 is not used: --fast_paths false sets "
                                                   "it to 0"), warned
