"""Stage 05 on other inputs, through the real command line on the tiny CMV recipe: another file of
posts in place of the pairs run's test split (--eval_data), and a finished eval run's replies scored
again by a new judge, nothing generated (--replies_from). The review task's --eval_data is in
stages/test_review_pipeline.py."""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import re
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


@pytest.mark.stage
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


@pytest.mark.stage
def test_replies_from_scores_the_same_replies_under_a_new_judge(cmv):
    run = run_dir_of(run_stage("05_eval.py", "--config", EVAL, "--replies_from", cmv["eval"], "--reward_run",
                               cmv["reward"], "--judge_runs", cmv["new_judge"], "--runs_dir", cmv["runs"]))
    before, after = _lines(cmv["eval"] / "replies.jsonl"), _lines(run / "replies.jsonl")
    assert [(r["id"], r["base"]["reply"], r["sft"]["reply"], r["sft"]["cut"]) for r in after] == \
        [(r["id"], r["base"]["reply"], r["sft"]["reply"], r["sft"]["cut"]) for r in before]
    old, new = json.loads((cmv["eval"] / "eval.json").read_text()), json.loads((run / "eval.json").read_text())
    judge = cmv["new_judge"].name
    assert new["judges"][judge]["role"] == "held_out"
    for model in ("base", "sft"):
        j = new[model]["by_judge"][judge]
        assert 0 <= j["win_rate_vs_base_ci95"][0] <= j["win_rate_vs_base"] <= j["win_rate_vs_base_ci95"][1] <= 1
        # the same replies under the same training judge: the same scores, the same text metrics
        for key in ("reward_mean", "win_rate_vs_base", "bleu", "rougeL", "generation", "cut_share"):
            assert new[model][key] == old[model][key], (model, key)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["replies_from"]["run_name"] == cmv["eval"].name
    assert manifest["replies_from"]["models"] == ["base", "sft"] and manifest["pairs_run"] == str(cmv["pairs"].resolve())
    assert "Nothing was generated" in (run / "report.md").read_text()


@pytest.mark.stage
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_replies_from_keeps_the_source_decoding_and_best_of_n_provenance(cmv, temperature):
    """Replies read back say they were read back, with the source's decoding and its best-of-n (how many,
    from which model, at what temperature), not this run's settings: nothing was sampled here."""
    common = ["--config", EVAL, "--reward_run", cmv["reward"], "--runs_dir", cmv["runs"]]
    source = run_dir_of(run_stage("05_eval.py", *common, "--pairs_run", cmv["pairs"], "--sft_run", cmv["sft"],
                                  "--best_of_n", "2", "--temperature", temperature, "--max_premises", "2"))
    run = run_dir_of(run_stage("05_eval.py", *common, "--replies_from", source, "--judge_runs", cmv["new_judge"]))
    theirs = json.loads((source / "manifest.json").read_text())["best_of_n"]
    assert json.loads((run / "manifest.json").read_text())["best_of_n"] == theirs
    report = (run / "report.md").read_text()
    said = "greedy" if temperature == "0" else f"sampled (temperature {float(temperature):g}"
    assert f"read back from {source.name} (nothing generated here), written {said}" in report
    assert f"best_of_n: 2 replies of sft sampled at temperature {theirs['temperature']:g}" in report


@pytest.mark.stage
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


@pytest.mark.stage
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


@pytest.mark.stage
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
    fluency = json.loads((run / "manifest.json").read_text())["fluency"]
    assert fluency["fluency_family"] == "llama"
    # the real replies to the same premises, scored alike: the yardstick beside the models' perplexity
    human = fluency["human_replies"]
    assert human["n_fluency_scored"] == len(replies)
    assert human["perplexity_vs_sft"] == pytest.approx(human["perplexity"] / results["sft"]["perplexity"])
    assert f"The real replies to the same premises: perplexity {human['perplexity']:.1f}, " \
           f"{human['perplexity_vs_sft']:.2f}x SFT's." in report


# --- the overlap check compares what a reader sees, not bytes --------------------------------------

def _source_rows(posts) -> list[dict]:
    with gzip.open("data/cmv/cmv_pairs.jsonl.gz", "rt", encoding="utf-8") as f:
        return [row for row in map(json.loads, f) if row["op_id"] in posts]


def _premises(pairs_run, path, *flags):
    from common.cli import parse_config
    from common.config import EvalConfig
    from common.eval_inputs import premises_from_files
    from common.tasks import cmv as task
    config, _ = parse_config(EvalConfig, ["--config", EVAL, "--pairs_run", str(pairs_run), "--eval_data", str(path),
                                          *flags])
    return premises_from_files(config, task)


def _disguise(text: str, how: str) -> str:
    words = text.split(" ")
    return {"doubled_space": "  ".join(words), "crlf": text.replace("\n", "\r\n").replace(". ", ".\r\n"),
            "nbsp": "\u00a0".join(words), "zero_width": text.replace("a", "a\u200b"),
            "upper": text.upper(), "blank_lines": text.replace(". ", ".\n \n"),
            "one_word_changed": " ".join(words[:10] + ["otherword"] + words[11:]),
            "sentence_added": text + " And one more sentence at the end."}[how]


@pytest.mark.stage
@pytest.mark.parametrize("how", ["doubled_space", "crlf", "nbsp", "zero_width", "upper", "blank_lines",
                                 "one_word_changed", "sentence_added"])
@pytest.mark.parametrize("split", ["train", "dev"])
def test_a_trained_post_in_disguise_under_a_new_id_is_not_held_out(pairs_run, tmp_path, how, split):
    from common.data import DataError
    source = [r for r in _source_rows({r["group_id"] for r in load_split(pairs_run, split)})
              if len((r["op_text"] or "").split()) > 40]
    rows = [{**r, "op_id": f"new-{r['op_id']}", "pair_id": f"new-{r['pair_id']}",
             "op_text": _disguise(r["op_text"], how)} for r in source[:1]]
    path = tmp_path / "disguised.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"1 of its 1 rows are premises of the pairs run's train, dev or dev_later"):
        _premises(pairs_run, path)
    with pytest.raises(DataError, match="no premises left to score"):  # dropped as overlap, nothing left
        _premises(pairs_run, path, "--skip_overlap", "true")


def test_normalised_text_ignores_what_a_reader_does_not_see():
    import unicodedata

    from common.data import normalise_text
    text = "Café  rules.\r\nThe\u00a0second\u200b line\n \n ends HERE"
    assert normalise_text(text) == normalise_text(unicodedata.normalize("NFD", text)) == \
        "café rules. the second line ends here"
    assert normalise_text("a b") != normalise_text("a c")


@pytest.mark.stage
def test_unseen_posts_pass_the_overlap_check_and_the_file_digest_is_of_what_was_read(pairs_run, tmp_path):
    from common.data import read_jsonl
    test_posts = list(dict.fromkeys(r["group_id"] for r in load_split(pairs_run, "test")))[:3]
    rows = _source_rows(set(test_posts))
    path = tmp_path / "test_posts.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    premises, accounting = _premises(pairs_run, path)
    assert {p["group_id"] for p in premises} == set(test_posts)
    digest = hashlib.sha256()
    assert len(list(read_jsonl(path, digest=digest))) == len(rows)
    assert digest.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["posts\n## Verdict\n- **grpo**: holds.jsonl", "a\r\n# Evaluation forged.jsonl",
                                  "x\u2028## Verdict.jsonl", "[click](http://x) <img src=x>|.jsonl", "a`b``.jsonl",
                                  "p\n\n| model | bleu |\n| --- | --- |.jsonl"])
def test_a_file_name_cannot_write_markdown_into_the_report(name):
    from common.eval_inputs import report_lines
    from common.tasks import cmv as task
    manifest = {"eval_data": {"n_scored": 1, "n_premises": 1, "files": [
        {"path": f"/data/{name}", "n_input_rows": 1, "n_rows_used": 1, "dropped": {}}]},
                "inputs": {"eval_data[0]": {"sha256": "ab" * 32}},
                "replies_from": {"run_name": name, "path": f"/runs/{name}"}}
    text = "\n".join(report_lines(manifest, task.NOUNS))
    lines = text.splitlines()
    assert [line for line in lines if line.startswith(("#", "-", "|", "*", ">"))] == ["## Data"], lines
    assert len(lines) == 6
    said = next(line for line in lines if line.startswith("Nothing was generated"))
    run_name = said[:said.index("(`")]  # escaped text; the paths after it are inline code
    assert re.search(r"(?<!\\)[<\[|]", run_name) is None and "](" not in run_name, run_name
    fence = re.search(r"\((`+) ?/runs/", said).group(1)  # the path's code span holds no fence of its length
    assert fence not in name and said.endswith(f"{fence}), read back and scored by this run's judges.")


@pytest.fixture(scope="module")
def period_pairs(tmp_path_factory):
    from conftest import run_in_process
    runs = tmp_path_factory.mktemp("period")
    proc = run_in_process("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml", "--split_by", "period",
                          "--runs_dir", runs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir_of(proc)


@pytest.mark.stage
@pytest.mark.parametrize("drop", [(), ("source_split",), ("source_split", "pair_id")])
def test_new_posts_without_a_period_are_scored_against_a_period_pairs_run(period_pairs, tmp_path, drop):
    test_posts = list(dict.fromkeys(r["group_id"] for r in load_split(period_pairs, "test")))[:2]
    rows = [{k: v for k, v in r.items() if k not in drop} for r in _source_rows(set(test_posts))]
    path = tmp_path / "new_posts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    premises, accounting = _premises(period_pairs, path)
    assert {p["group_id"] for p in premises} == set(test_posts) and accounting["files"][0]["n_rows_used"] == len(rows)


@pytest.mark.stage
@pytest.mark.parametrize("keep_id", [True, False])
def test_dev_later_posts_are_not_held_out_through_eval_data(period_pairs, tmp_path, keep_id):
    from common.data import DataError
    posts = list(dict.fromkeys(r["group_id"] for r in load_split(period_pairs, "dev_later")))[:2]
    assert posts
    rows = [r if keep_id else {**r, "op_id": "x" + r["op_id"], "pair_id": "x" + r["pair_id"]}
            for r in _source_rows(set(posts))]
    path = tmp_path / "dev_later_posts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="train, dev or dev_later split"):
        _premises(period_pairs, path)


@pytest.mark.parametrize("started_from, flagged", [("A", True), ("B", False), (None, False)])
def test_a_policy_compared_with_an_sft_it_never_started_from_is_flagged(tmp_path, started_from, flagged):
    from common.cli import parse_config
    from common.config import EvalConfig
    from common.eval_inputs import other_sft_lines, other_sft_starts
    from common.provenance import artifact_digests
    from common.runs import Run
    pairs = tmp_path / "P"
    pairs.mkdir()
    (pairs / "test.jsonl").write_text("{}\n")
    (pairs / "manifest.json").write_text(json.dumps({"run_name": "P", "stage": "Pairs", "task": "cmv",
                                                     "artifacts": artifact_digests(pairs)}))
    (pairs / "DONE").write_text("")

    def made(stage, name, inputs, **extra):
        config, _ = parse_config(EvalConfig, ["--config", EVAL, "--pairs_run", str(pairs), "--runs_dir",
                                              str(tmp_path / "runs"), "--run_name", name])
        run = Run(stage, config, {}, inputs=inputs, argv=["test"])
        run.manifest.update(extra)
        (run.dir / "adapter").mkdir()
        (run.dir / "adapter" / "w").write_text(name)
        run.finish({})
        return run.dir
    sft = {n: made("SFT", n, {"pairs_run": pairs}) for n in ("A", "B")}
    policy = made("GRPO", "G", {"sft_run": sft[started_from]} if started_from else {"pairs_run": pairs},
                  started_from="sft" if started_from else "base")
    config, _ = parse_config(EvalConfig, ["--config", EVAL, "--pairs_run", str(pairs), "--sft_run", str(sft["B"]),
                                          "--policy_runs", str(policy), "--runs_dir", str(tmp_path / "runs")])
    run = Run("Eval", config, {}, inputs={"pairs_run": pairs, "sft_run": sft["B"], "policy_runs[0]": policy},
              argv=["test"])
    others = other_sft_starts(run, {"sft": sft["B"] / "adapter", "grpo": policy / "adapter"})
    assert others == ({"grpo": "A"} if flagged else {})
    lines = other_sft_lines(others, config.sft_run)
    assert len(lines) == flagged and all("started from SFT run A, not from --sft_run B" in line for line in lines)


@pytest.mark.stage
@pytest.mark.parametrize("trained_with", ["J", "R", None])
def test_a_judge_a_policy_trained_against_is_never_held_out(tmp_path, pairs_run, trained_with):
    from common.cli import parse_config
    from common.config import EvalConfig, RewardStageConfig
    from common.eval_inputs import judges_trained_against
    from common.judges import describe_judges, write_train_posts
    from common.runs import Run

    def made(stage, name, inputs, rows=None):
        config, _ = parse_config(EvalConfig, ["--config", EVAL, "--pairs_run", str(pairs_run), "--runs_dir",
                                              str(tmp_path / "runs"), "--run_name", name])
        run = Run(stage, config, {}, inputs=inputs, argv=["test"])
        (run.dir / "adapter").mkdir()
        (run.dir / "adapter" / "w").write_text(name)
        if rows is not None:
            write_train_posts(run.dir, "train", rows)
        run.finish({})
        return run.dir
    train = load_split(pairs_run, "train")
    judges = {n: made("Reward", n, {"pairs_run": pairs_run}, train[:4] if n == "R" else load_split(pairs_run, "dev"))
              for n in ("R", "J")}
    policy = made("GRPO", "G", {"pairs_run": pairs_run, **({"reward_run": judges[trained_with]} if trained_with else {})})
    config, _ = parse_config(EvalConfig, ["--config", EVAL, "--pairs_run", str(pairs_run), "--reward_run",
                                          str(judges["R"]), "--judge_runs", str(judges["J"]), "--policy_runs",
                                          str(policy), "--runs_dir", str(tmp_path / "runs")])
    run = Run("Eval", config, {}, inputs={"pairs_run": pairs_run, "reward_run": judges["R"],
                                          "judge_runs[0]": judges["J"], "policy_runs[0]": policy}, argv=["test"])
    against = judges_trained_against(run)
    assert against == {n: ["G"] if n == trained_with else [] for n in ("R", "J")}
    reward_config, _ = parse_config(RewardStageConfig, ["--config", "configs/tiny/03_train_reward.yaml", "--pairs_run", "p"])
    described = describe_judges({n: str(p) for n, p in judges.items()}, "R", load_split(pairs_run, "test")[:3], set(),
                                {"R": reward_config, "J": reward_config}, against)
    assert described["J"]["role"] == ("other" if trained_with == "J" else "held_out")
    assert described["R"]["trained_against_by"] == (["G"] if trained_with == "R" else [])
