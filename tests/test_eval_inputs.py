"""Stage 05 on other inputs, through the real command line on the tiny CMV recipe: another file of
posts in place of the pairs run's test split (--eval_data), and a finished eval run's replies scored
again by a new judge, nothing generated (--replies_from). The review task's --eval_data is in
test_review_pipeline.py."""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil

import pytest
from conftest import run_dir_of, run_stage

from common.data import load_split

EVAL = "configs/tiny/05_eval.yaml"


@pytest.fixture(scope="module")
def cmv(tiny_model, pairs_run, tmp_path_factory) -> dict:
    runs = tmp_path_factory.mktemp("eval_inputs")
    common = ["--runs_dir", runs]
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run",
                               pairs_run, *common))
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, *common))
    source = run_dir_of(run_stage("05_eval.py", "--config", EVAL, "--pairs_run", pairs_run, "--reward_run", reward,
                                  "--sft_run", sft, *common))
    # a judge trained after the eval: pointwise, on the dev posts
    new_judge = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                     "--pairs_run", pairs_run, "--judge_objective", "pointwise", "--train_split", "dev",
                                     "--audit_split", "test", "--run_name", "New_Judge", *common))
    # a judge that trained on the posts scored: the test split's first ones
    test_judge = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                      "--pairs_run", pairs_run, "--train_split", "test", "--audit_split", "dev",
                                      "--run_name", "Test_Posts_Judge", *common))
    # another file of posts: the bundled rows of the test split's first three posts
    posts = list(dict.fromkeys(row["group_id"] for row in load_split(pairs_run, "test")))[:3]
    with gzip.open("data/cmv/cmv_pairs.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [row for row in map(json.loads, f) if row["op_id"] in posts]
    other = runs / "other_posts.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"pairs": pairs_run, "sft": sft, "reward": reward, "eval": source, "new_judge": new_judge,
            "test_judge": test_judge, "other": other, "other_rows": rows, "runs": runs}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_data_scores_another_file_of_posts(cmv):
    other, rows = cmv["other"], cmv["other_rows"]
    run = run_dir_of(run_stage("05_eval.py", "--config", EVAL, "--pairs_run", cmv["pairs"], "--reward_run",
                               cmv["reward"], "--sft_run", cmv["sft"], "--eval_data", other, "--runs_dir", cmv["runs"]))
    replies = _lines(run / "replies.jsonl")
    assert len(replies) == 3 and {r["id"] for r in replies} <= {r["pair_id"] for r in rows}  # one premise a post
    results = json.loads((run / "eval.json").read_text())
    assert 0 <= results["sft"]["win_rate_vs_base"] <= 1 and results["base"]["win_rate_vs_base"] == 0.5
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["eval_data[0]"]["sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()
    (counts,) = manifest["eval_data"]["files"]
    assert counts["n_input_rows"] == len(rows) and manifest["eval_data"]["n_premises"] == 3
    assert "--eval_data" in (run / "report.md").read_text()


def test_replies_from_scores_the_same_replies_under_a_new_judge(cmv):
    run = run_dir_of(run_stage("05_eval.py", "--config", EVAL, "--replies_from", cmv["eval"], "--reward_run",
                               cmv["reward"], "--judge_runs", cmv["new_judge"], "--runs_dir", cmv["runs"]))
    before, after = _lines(cmv["eval"] / "replies.jsonl"), _lines(run / "replies.jsonl")
    assert [(r["id"], r["base"]["reply"], r["sft"]["reply"]) for r in after] == \
        [(r["id"], r["base"]["reply"], r["sft"]["reply"]) for r in before]
    old, new = json.loads((cmv["eval"] / "eval.json").read_text()), json.loads((run / "eval.json").read_text())
    judge = cmv["new_judge"].name
    assert new["judges"][judge]["role"] == "held_out"
    for model in ("base", "sft"):
        j = new[model]["by_judge"][judge]
        assert 0 <= j["win_rate_vs_base_ci95"][0] <= j["win_rate_vs_base"] <= j["win_rate_vs_base_ci95"][1] <= 1
        # the same replies under the same training judge: the same scores, the same text metrics
        for key in ("reward_mean", "win_rate_vs_base", "bleu", "rougeL", "generation"):
            assert new[model][key] == old[model][key], (model, key)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["replies_from"]["run_name"] == cmv["eval"].name
    assert manifest["replies_from"]["models"] == ["base", "sft"] and manifest["pairs_run"] == str(cmv["pairs"].resolve())
    assert "Nothing was generated" in (run / "report.md").read_text()


def test_replies_from_refuses_a_changed_replies_file_and_changed_decoding(cmv, tmp_path):
    changed = tmp_path / cmv["eval"].name
    shutil.copytree(cmv["eval"], changed)
    rows = _lines(changed / "replies.jsonl")
    rows[0]["sft"]["reply"] += " And one more sentence."
    (changed / "replies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for flags, message in (([changed], f"error: input run {changed}: replies.jsonl changed after the run finished"),
                           ([cmv["eval"], "--max_new_tokens", "99"], "error: command line: --max_new_tokens 99: the "
                                                                     "replies of --replies_from")):
        proc = run_stage("05_eval.py", "--config", EVAL, "--judge_runs", cmv["new_judge"], "--runs_dir",
                         tmp_path / "runs", "--replies_from", *flags, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-1000:]


def test_a_judge_trained_on_a_scored_premise_is_refused_on_other_files_and_on_replies_read_back(cmv, tmp_path):
    judge = cmv["test_judge"]
    for inputs in (["--pairs_run", cmv["pairs"], "--sft_run", cmv["sft"], "--eval_data", cmv["other"]],
                   ["--replies_from", cmv["eval"]]):
        proc = run_stage("05_eval.py", "--config", EVAL, *inputs, "--judge_runs", judge, "--runs_dir", tmp_path,
                         check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"error: --judge_runs {judge}: judge {judge.name} trained on ") and \
            "premises it would score" in line, line


def test_replies_read_back_get_fluency_figures_and_a_verdict(cmv, tiny_model):
    """The fluency check on replies read back (common/verdict.py): each model's mean log-probability and
    perplexity under a frozen LM, the ratio to SFT's, and the verdict that needs both checks."""
    run = run_dir_of(run_stage("05_eval.py", "--config", EVAL, "--replies_from", cmv["eval"], "--reward_run",
                               cmv["reward"], "--judge_runs", cmv["new_judge"], "--fluency_model_name_or_path",
                               tiny_model, "--runs_dir", cmv["runs"]))
    results, replies = json.loads((run / "eval.json").read_text()), _lines(run / "replies.jsonl")
    for model in ("base", "sft"):
        kept = [r[model]["fluency_log_prob"] for r in replies if r[model]["fluency_log_prob"] is not None]
        assert kept and results[model]["mean_log_prob"] == pytest.approx(sum(kept) / len(kept))
        assert results[model]["perplexity"] == pytest.approx(math.exp(-sum(kept) / len(kept)))
    assert results["sft"]["perplexity_vs_sft"] == 1.0
    assert results["base"]["perplexity_vs_sft"] == pytest.approx(results["base"]["perplexity"] /
                                                                 results["sft"]["perplexity"])
    # every judge here is a tiny llama, and so is the fluency model: nothing can hold, and the report says why
    assert {j["family"] for j in results["judges"].values()} == {"llama"}
    verdict = results["sft"]["verdict"]
    assert verdict["reference"] == "base" and not verdict["holds"] and verdict["reasons"]
    assert "verdict" not in results["base"]
    report = (run / "report.md").read_text()
    assert "| perplexity | perplexity vs SFT |" in report and "**sft** vs base: rejected: " in report
    assert "The fluency model is of the policy's family (llama)" in report
    assert "Every held-out judge is of the training judge's family (llama)" in report
    assert json.loads((run / "manifest.json").read_text())["fluency"]["fluency_family"] == "llama"
