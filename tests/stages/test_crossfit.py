"""Cross-fitting (docs/results.md, "Held-out judges in stage 05"): stage 03's folds are disjoint by post,
cover the split and do not move with the seed; two judges, each leaving one fold of the test posts out,
serve stage 05 as one held-out judge, every premise scored by the fold judge that never trained on its
post; a set that is not one whole cross-fit, or a fold judge given alone, is refused."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from conftest import load_stage, run_dir_of, run_stage, tiny_bert

from common.config import ConfigError, RewardStageConfig, load_run_config
from common.data import cross_fit, fit_prompt, fold_of, load_split, one_per_group
from common.runs import RunError

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)

TINY = ".cache/models/tiny-llama3"


def _config(pairs_run, **fields):
    return RewardStageConfig(model_name_or_path=TINY, pairs_run=str(pairs_run), **fields)


def test_folds_are_disjoint_by_post_cover_the_split_and_ignore_order_and_seed(pairs_run):
    rows = load_split(pairs_run, "test")
    folds = [cross_fit(rows, 3, j)[1] for j in range(3)]
    posts = [{r["group_id"] for r in fold} for fold in folds]
    assert all(posts) and sum(map(len, folds)) == len(rows)
    assert not (posts[0] & posts[1] or posts[0] & posts[2] or posts[1] & posts[2])
    kept, left_out = cross_fit(rows, 3, 1)
    assert {r["id"] for r in kept} | {r["id"] for r in left_out} == {r["id"] for r in rows}
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    assert {r["id"] for r in cross_fit(shuffled, 3, 1)[1]} == {r["id"] for r in left_out}
    # stage 03 cuts the same folds whatever its seed
    stage = load_stage("03_train_reward.py")
    picked = [stage.training_pairs(_config(pairs_run, train_split="test", cross_fit_folds=2, cross_fit_fold=0,
                                           seed=seed)) for seed in (1, 2)]
    assert picked[0] == picked[1]
    trained, out = picked[0]
    assert {r["group_id"] for r in trained} == {r["group_id"] for r in rows if fold_of(r["group_id"], 2) == 1}
    assert set(out) == {"test_fold0"} and {fold_of(r["group_id"], 2) for r in out["test_fold0"]} == {0}
    # train_also adds a split's pairs after train_split's
    trained, _ = stage.training_pairs(_config(pairs_run, train_split="test", train_also=["train"], cross_fit_folds=2))
    assert trained[len(cross_fit(rows, 2, 0)[0]):] == load_split(pairs_run, "train")


@pytest.mark.parametrize("fields, field", [
    ({"train_split": "test", "cross_fit_folds": 1}, "cross_fit_folds"),
    ({"train_split": "test", "cross_fit_folds": 2, "cross_fit_fold": 2}, "cross_fit_fold"),
    ({"train_split": "test", "cross_fit_fold": 1}, "cross_fit_fold"),
    ({"cross_fit_folds": 2}, "train_split"),
    ({"train_split": "test", "train_also": ["test"]}, "train_also"),
    ({"train_split": "test", "train_also": ["dev"]}, "train_also"),  # audit_split dev
    ({"train_split": "test", "audit_split": "train", "train_also": ["dev", "dev"]}, "train_also"),
])
def test_cross_fit_settings_are_checked(pairs_run, fields, field):
    with pytest.raises(ConfigError) as err:
        _config(pairs_run, **fields)
    assert err.value.field == field


@pytest.fixture(scope="module")
def cross_fit_runs(tiny_model, pairs_run, tmp_path_factory):
    """A 2-fold cross-fit of the test posts with a tiny random BERT (MiniLM's tokenizer) as the encoder
    judge: every pair of the other fold trained on, so each test post is trained on by exactly one judge."""
    runs = tmp_path_factory.mktemp("crossfit")
    bert = tiny_bert(runs)
    folds = [run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward_minilm.yaml",
                                  "--pairs_run", pairs_run, "--judge_model_name_or_path", bert,
                                  "--train_split", "test", "--cross_fit_folds", 2, "--cross_fit_fold", j,
                                  "--max_train_examples", 1000, "--run_name", f"Fold{j}", "--runs_dir", runs))
             for j in (0, 1)]
    eval_args = ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run, "--max_premises", 6,
                 "--runs_dir", runs]
    proc = run_stage("05_eval.py", *eval_args, "--crossfit_judge_runs", folds[1], folds[0], "--run_name", "Eval")
    return {"folds": folds, "eval": run_dir_of(proc), "runs": runs, "eval_args": eval_args, "pairs": pairs_run}


def test_each_fold_judge_trains_on_the_other_fold_and_audits_its_own(cross_fit_runs):
    test = load_split(cross_fit_runs["pairs"], "test")
    for j, run in enumerate(cross_fit_runs["folds"]):
        saved = json.loads((run / "train_posts.json").read_text())
        assert saved["split"] == "test" and saved["cross_fit"] == {"folds": 2, "fold": j}
        assert set(saved["posts"]) == {r["group_id"] for r in test if fold_of(r["group_id"], 2) != j}
        summary = json.loads((run / "metrics.json").read_text())["judge_audit"]
        assert 0 <= summary[f"test_fold{j}_accuracy"] <= 1 and "test_accuracy" not in summary  # test: trained on
        assert f"test_fold{j}" in json.loads((run / "judge_audit.json").read_text())["other_splits"]


def test_eval_scores_every_premise_with_the_judge_that_never_saw_its_post(cross_fit_runs, pairs_run):
    from common.model import load_tokenizer
    from common.rewards import RewardScorer
    folds, run = cross_fit_runs["folds"], cross_fit_runs["eval"]
    results = json.loads((run / "eval.json").read_text())
    judges = results.pop("judges")
    name = f"{folds[0].name}_crossfit"
    assert list(judges) == [name] and judges[name]["role"] == "held_out"
    assert judges[name]["posts_shared_with_policy"] == 0 and judges[name]["train_split"] == "test"
    assert sum(judges[name]["cross_fit"]["premises_scored"].values()) == 6
    assert judges[name]["family"] == "bert"  # its fold judges' backbone: a tiny BERT (common/verdict.py)
    assert set(results["base"]["by_judge"]) == {name} and results["base"]["by_judge"][name]["win_rate_vs_base"] == 0.5
    report = (run / "report.md").read_text()
    assert f"**{name}**: pairwise encoder judge" in report and "Cross-fitted: 2 judges" in report

    # By hand: each premise's post is in exactly one judge's train_posts.json; its score is the other's.
    trained = [set(json.loads((f / "train_posts.json").read_text())["posts"]) for f in folds]
    premises = one_per_group(load_split(pairs_run, "test"))[:6]
    replies = [json.loads(line) for line in (run / "replies.jsonl").read_text().splitlines()]
    config = load_run_config(run)
    prompts = [fit_prompt(load_tokenizer(config), p["prompt"], config.max_prompt_tokens) for p in premises]
    scorers = [RewardScorer.from_run(f) for f in folds]
    for premise, prompt, row in zip(premises, prompts, replies):
        assert row["id"] == premise["id"]
        (judge,) = [j for j in (0, 1) if premise["group_id"] not in trained[j]]
        assert premise["group_id"] in trained[1 - judge]
        again = scorers[judge].score([prompt], [row["base"]["reply"]])[0]
        assert row["base"]["by_judge"][name] == pytest.approx(again, abs=1e-4)


def test_a_fold_judge_alone_or_a_set_missing_a_fold_is_refused(cross_fit_runs, tmp_path):
    folds, args = cross_fit_runs["folds"], cross_fit_runs["eval_args"]
    twin = tmp_path / "Fold0_again"
    shutil.copytree(folds[0], twin)

    def refused(*extra):
        proc = run_stage("05_eval.py", *args, *extra, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stderr.strip().splitlines()[-1]

    assert "trained on" in refused("--judge_runs", folds[1]) and "premises it would score" in refused(
        "--judge_runs", folds[0])
    assert refused("--crossfit_judge_runs", folds[0], twin) == (
        "error: --crossfit_judge_runs: a 2-fold cross-fit takes one run per fold, 0 to 1: fold 1 missing and "
        "fold 0 given twice")
    assert "'crossfit_judge_runs'" in refused("--crossfit_judge_runs", folds[0])
    (twin / "DONE").unlink()
    assert "no DONE marker" in refused("--crossfit_judge_runs", folds[1], twin)


def test_a_set_that_is_not_one_cross_fit_or_saw_every_premise_is_refused(cross_fit_runs, tmp_path):
    from common.judges import CrossFitScorer
    folds, pairs = cross_fit_runs["folds"], cross_fit_runs["pairs"]
    premises = one_per_group(load_split(pairs, "test"))[:6]
    prompts = [p["prompt"] for p in premises]
    other = tmp_path / "Fold1_other_recipe"
    shutil.copytree(folds[1], other)
    (other / "config.yaml").write_text((other / "config.yaml").read_text().replace("learning_rate: 0.0001",
                                                                                   "learning_rate: 0.001"))
    with pytest.raises(RunError, match="differ in 'learning_rate'"):
        CrossFitScorer([folds[0], other], premises, prompts, pairs, taken={})
    both = tmp_path / "Fold1_saw_all"
    shutil.copytree(folds[1], both)
    saved = json.loads((both / "train_posts.json").read_text())
    saved["posts"] += [p["group_id"] for p in premises]
    (both / "train_posts.json").write_text(json.dumps(saved))
    with pytest.raises(RunError, match=r"every judge of the cross-fit Fold0_crossfit trained on \d+ of the 6 premises"):
        CrossFitScorer([folds[0], both], premises, prompts, pairs, taken={})
    scorer = CrossFitScorer([folds[1], folds[0]], premises, prompts, pairs, taken={})
    assert scorer.runs == folds and scorer.name == "Fold0_crossfit"
    with pytest.raises(RunError, match="another judge's run name"):
        CrossFitScorer(folds, premises, prompts, pairs, taken={"Fold0_crossfit": {}})
