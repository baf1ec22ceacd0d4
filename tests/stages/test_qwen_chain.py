"""The CMV chain 01 -> 02 -> 03 -> 04 GRPO -> 05 on a tiny random Qwen2 (configs/tiny with
--model_name_or_path, the stages' own command lines): the code path of configs/qwen-gpu/ in CI. Qwen2's
q/k/v biases and tied embeddings, a ChatML template with a default system turn, a system prompt of our
own in the pairs; GRPO's rollouts and the eval's replies come from the static decoder, and the runs say so."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_dir_of, run_in_process, tiny_arch

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)


def _stage(script, *args):
    proc = run_in_process(script, *args)
    assert proc.returncode == 0, f"{script}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return run_dir_of(proc)


def test_the_cmv_chain_runs_on_a_qwen2_model(tmp_path):
    qwen = str(tiny_arch(tmp_path, "qwen2"))
    runs = ["--runs_dir", tmp_path / "runs"]
    model = ["--model_name_or_path", qwen]
    system = "You reply to r/ChangeMyView posts: change the author's view."
    pairs = _stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--system_prompt", system, *runs)
    sft = _stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs, *model, *runs)
    judge = _stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml", "--pairs_run", pairs,
                   "--max_steps", 2, *model, *runs)
    grpo = _stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--sft_run", sft,
                  "--reward_run", judge, *model, *runs)
    evaluation = _stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs,
                        "--reward_run", judge, "--sft_run", sft, "--policy_runs", grpo, "--temperature", 1.0, *model, *runs)

    first = json.loads((pairs / "train.jsonl").read_text().splitlines()[0])
    assert first["prompt"][0] == {"role": "system", "content": system} and first["prompt"][-1]["role"] == "user"
    assert yaml.safe_load((pairs / "config.yaml").read_text())["system_prompt"] == system
    for run in (sft, judge, grpo):
        assert yaml.safe_load((run / "config.yaml").read_text())["model_name_or_path"] == qwen
    grpo_backends = json.loads((grpo / "manifest.json").read_text())["backends"]
    assert grpo_backends["decoder"] == "static"  # a Qwen2 is Llama-shaped: its rollouts take the static decoder
    assert json.loads((evaluation / "manifest.json").read_text())["backends"]["decoder"] == "static"
    assert grpo_backends["judge_scoring"] == "packed" and "group_in_one_sequence" in grpo_backends["patches"]
    results = json.loads((evaluation / "eval.json").read_text())
    models = results.get("models", results)
    assert {"base", "sft", "grpo"} <= set(models)
    for name in ("base", "sft", "grpo"):
        assert 0 <= models[name]["refusal_share"] <= 1 and models[name]["n"] > 0
        assert models[name]["reply_words_mean"] > 0  # sampled: greedy, a tied-embedding random model says "\n"
    assert "| refused |" in (evaluation / "report.md").read_text()


def test_a_system_prompt_is_refused_for_the_review_task(tmp_path):
    proc = run_in_process("01_build_pairs.py", "--config", "configs/qwen-gpu/review/01_build_pairs.yaml",
                          "--system_prompt", "You review papers.", "--runs_dir", tmp_path)
    assert proc.returncode != 0 and "field 'system_prompt'" in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # refused before any run directory
