"""`split_by: period` (docs/data.md): the test split is the source's later period, posts whole, every
split length-balanced and every row accounted for; stage 03's audit names that split; the script that
measures judges on later posts runs end to end on the CPU."""
from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

import pytest
from conftest import REPO, run_dir_of, run_stage, tiny_bert

from common.data import length_only_accuracy, load_split

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)

BUNDLED = REPO / "data" / "cmv" / "cmv_pairs.jsonl.gz"


@pytest.fixture(scope="module")
def period_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("period")
    return run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/smol/01_build_pairs.yaml",
                                "--runs_dir", runs))


def test_period_split_puts_exactly_the_later_posts_in_dev_later_and_test_whole(period_run):
    rows = [json.loads(line) for line in gzip.open(BUNDLED, "rt", encoding="utf-8")]
    later_posts = {r["op_id"] for r in rows if r["source_split"] == "heldout"}
    splits = {s: load_split(period_run, s) for s in ("train", "dev", "dev_later", "test")}
    posts = {s: {p["group_id"] for p in rows_} for s, rows_ in splits.items()}
    later = splits["dev_later"] + splits["test"]
    assert posts["test"] | posts["dev_later"] <= later_posts and not (posts["train"] | posts["dev"]) & later_posts
    assert not posts["train"] & posts["dev"] and not posts["test"] & posts["dev_later"]
    # dev_later holds about later_dev_fraction (0.4) of the later posts, drawn whole by post.
    share = len(posts["dev_later"]) / len(posts["dev_later"] | posts["test"])
    assert 0.35 < share < 0.45, share
    # Every kept later-period row is in dev_later or test; the only others there share a post with one.
    assert all(p["source_split"] != "heldout" for s in ("train", "dev") for p in splits[s])
    by_post = defaultdict(set)
    for r in rows:
        by_post[r["op_id"]].add(r["source_split"])
    mixed = {op for op, periods in by_post.items() if "heldout" in periods and len(periods) > 1}
    others = [p for p in later if p["source_split"] != "heldout"]
    assert others and {p["group_id"] for p in others} <= mixed

    metrics = json.loads((period_run / "metrics.json").read_text())
    assert metrics["split_by"] == "period"
    for name in ("dev_later", "test"):
        n_other = sum(p["source_split"] != "heldout" for p in splits[name])
        assert metrics["source_split"][name] == {"heldout": len(splits[name]) - n_other,
                                                 **({"unknown": n_other} if n_other else {})}
    assert set(metrics["source_split"]["train"]) == {"train", "unknown"}
    assert metrics["test_rows_of_other_periods_with_their_post"]["posts"] == len(mixed)
    # Balanced per split, as stage 01 reports it and as the files say.
    for name, rows_ in splits.items():
        assert metrics["length_only_accuracy"][name] == length_only_accuracy(rows_) == 0.5
        assert metrics["n_pairs"][name] == len(rows_)
    # Every row accounted for.
    assert metrics["n_input_rows"] == len(rows) == metrics["n_rows_used"] + sum(metrics["dropped"].values())
    assert sum(metrics["n_pairs"].values()) == metrics["n_rows_used"]


def test_later_dev_fraction_zero_leaves_every_later_post_in_test(tmp_path):
    whole = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/smol/01_build_pairs.yaml",
                                 "--later_dev_fraction", "0", "--runs_dir", tmp_path))
    assert load_split(whole, "dev_later") == []
    later = {r["op_id"] for r in map(json.loads, gzip.open(BUNDLED, "rt", encoding="utf-8"))
             if r["source_split"] == "heldout"}
    assert {p["group_id"] for p in load_split(whole, "test")} >= later & {
        p["group_id"] for s in ("train", "dev", "test") for p in load_split(whole, s)}


def test_eval_refuses_to_score_dev_later(tmp_path):
    proc = run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", tmp_path,
                     "--split", "dev_later", "--runs_dir", tmp_path / "runs", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and lines[-1].startswith("error: ") and "dev_later" in lines[-1], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_post_split_is_unchanged_and_reports_its_periods(pairs_run):
    metrics = json.loads((pairs_run / "metrics.json").read_text())
    assert metrics["split_by"] == "post" and "test_rows_of_other_periods_with_their_post" not in metrics
    assert sum(sum(c.values()) for c in metrics["source_split"].values()) == sum(metrics["n_pairs"].values())


@pytest.mark.parametrize("config, extra, field", [
    ("configs/tiny/review/01_build_pairs.yaml", ["--split_by", "period"], "split_by"),
    ("configs/smol/01_build_pairs.yaml", ["--test_fraction", "0.2"], "test_fraction"),
    ("configs/tiny/01_build_pairs.yaml", ["--split_by", "post", "--later_dev_fraction", "0.2"], "later_dev_fraction"),
])
def test_period_split_refuses_what_it_cannot_do(tmp_path, config, extra, field):
    proc = run_stage("01_build_pairs.py", "--config", config, *extra, "--runs_dir", tmp_path / "runs", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and lines[-1].startswith("error: ") and f"'{field}'" in lines[-1], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_audit_names_the_later_period_and_early_stopping_keeps_the_best_epoch(tmp_path, tiny_model):
    runs = tmp_path / "runs"
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml",
                                 "--split_by", "period", "--runs_dir", runs))
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs, "--max_steps", -1, "--num_train_epochs", 3,
                                  "--max_train_examples", 8, "--early_stopping_patience", 1, "--runs_dir", runs))
    audit = json.loads((reward / "judge_audit.json").read_text())
    assert audit["periods"] == {"dev": "in-period", "dev_later": "period", "test": "period"}
    assert "pairs from later posts (test, split_by period): accuracy" in audit["verdict"]["text"]
    for name in ("length_only", "bag_of_words"):
        assert {"dev_accuracy", "test_accuracy"} <= set(audit["baselines"][name])
    metrics = json.loads((reward / "metrics.json").read_text())
    summary = metrics["judge_audit"]
    assert metrics["split_by"] == "period" and summary["periods"]["test"] == "period"
    assert {"test_accuracy_ci95", "test_length_only_baseline_accuracy", "test_bag_of_words_baseline_accuracy"} <= set(summary)
    # Dev's loss after every epoch; the run keeps the lowest one's weights.
    losses = [e["eval_loss"] for e in metrics["log_history"] if "eval_loss" in e]
    assert losses and metrics["early_stopping"]["best_dev_loss"] == min(losses)


def test_eval_report_says_which_kind_of_held_out_a_judge_is(period_run, pairs_run):
    from common.config import RewardStageConfig
    from common.judges import _period
    from common.report import judges_section

    def judge(pairs, split):
        return RewardStageConfig(model_name_or_path=".cache/models/tiny-llama3", pairs_run=str(pairs),
                                 train_split=split, audit_split="train" if split != "train" else "dev")
    assert _period(judge(pairs_run, "dev")).startswith("in-period")
    assert "split by period: test is the later posts" in _period(judge(period_run, "dev"))
    assert _period(judge(period_run, "test")).startswith("trained on the later period's posts")
    info = {"role": "held_out", "objective": "pairwise", "backbone": "encoder", "model": "m", "train_split": "test",
            "period": _period(judge(period_run, "test"))}
    row = {"reward_mean": 0.0, "win_rate_vs_base": 0.5, "win_rate_vs_base_ci95": [0.4, 0.6],
           "lc_win_rate_vs_base": 0.5, "lc_win_rate_vs_base_ci95": [0.4, 0.6]}
    text = "\n".join(judges_section({"base": {"by_judge": {"J": row}}}, {"J": info}, []))
    assert "trained on the later period's posts" in text


def test_judges_later_posts_script_runs_on_the_cpu(tmp_path, tiny_model):
    """scripts/judges_later_posts.sh with the tiny recipes: a tiny random BERT with MiniLM's tokenizer in
    the encoder judges' place, the tiny Llama as the decoder judge."""
    import os
    import subprocess

    bert = tiny_bert(tmp_path)
    env = {**os.environ, "RUNS_DIR": str(tmp_path / "my runs"),  # a space in it: every path stays whole
           "SUMMARY_DIR": str(tmp_path / "summary"), "RECIPE_03": "configs/tiny", "MINILM": str(bert), "LONG_EPOCHS": "3",
           "PY": sys.executable, "ENSEMBLE_SIZES": "2"}
    proc = subprocess.run(["bash", "scripts/judges_later_posts.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    summary = json.loads((tmp_path / "summary" / "judges_later_posts.json").read_text())
    names = {"minilm_pairwise", "minilm_pairwise_premise256", "minilm_pairwise_lr5e-5_3ep", "minilm_pairwise_seed7",
             "minilm_pointwise", "minilm_pairwise_reply_only", "smollm2_decoder", "smollm2_decoder_lr3e-4", "features"}
    conservative = {"ensemble_min_best2", "ensemble_mean_minus_std_best2"}
    assert set(summary["judges"]) == names | conservative | {"ensemble"} and summary["chosen_on"] == "dev_later"
    for name, row in summary["judges"].items():
        if name != "ensemble":
            assert row["dev"]["period"] == "in-period" and row["test"]["period"] == "period"
        for split in ("dev_later", "test"):
            low, high = row[split]["accuracy_ci95"]
            assert 0 <= low <= row[split]["accuracy"] <= high <= 1
            assert 0 <= row[split]["length_only"] <= 1 and 0 <= row[split]["bag_of_words"] <= 1
        assert isinstance(row["meets_target_on_later_posts"], bool)
    default = [n for n, row in summary["judges"].items() if row.get("default")]
    ranked = sorted(names, key=lambda n: -summary["judges"][n]["dev_later"]["accuracy"])  # single judges only
    assert len(default) == 1 and proc.stdout.strip().splitlines()[-1].startswith(f"best: {default[0]} ")
    # the training judge: the best on dev_later of those that pass the gibberish audit; where none passes (a tiny
    # judge), the hardest to fool of those level with the best on dev_later
    shares = {n: summary["judges"][n]["gibberish_dev_later"] or 0.0 for n in names}
    passing = [n for n in ranked if shares[n] >= 0.98]
    if passing:
        assert default == passing[:1]
    else:
        sys.path.insert(0, str(REPO / "scripts"))
        from judges_later_posts import level_with
        run = {n: tmp_path / "my runs" / summary["judges"][n]["run"] for n in names}
        level = [ranked[0]] + [n for n in ranked[1:] if level_with(run[n], run[ranked[0]])]
        assert default[0] in level and shares[default[0]] == max(shares[n] for n in level)
    assert len(summary["judges"]["ensemble"]["runs"]) == 2
    # The conservative ensembles are of the two best single judges on dev_later.
    members = json.loads((tmp_path / "my runs" / "Judge_ensemble_min_best2" / "ensemble.json").read_text())["members"]
    assert [m["run_name"] for m in members] == [summary["judges"][n]["run"] for n in ranked[:2]]
    # The levers table: every single judge but the reference against minilm_pairwise, each ensemble against
    # its best member, with paired intervals on the same dev_later pairs.
    table = {row["judge"]: row for row in summary["levers"]}
    assert set(table) == (names | conservative) - {"minilm_pairwise"}
    assert table["features"]["lever"] == "features" and table["features"]["against"] == "minilm_pairwise"
    assert table["ensemble_min_best2"]["against"] == ranked[0]
    for row in table.values():
        low, high = row["gain_ci95"]
        assert row["n_pairs"] > 0 and low <= row["gain"] <= high
        assert row["gain"] == pytest.approx(row["accuracy"] - summary["judges"][row["against"]]["dev_later"]["accuracy"])
    markdown = (tmp_path / "summary" / "judges_later_posts.md").read_text()
    assert markdown.count("\n| ") == len(table) + 1 and "| features | features | minilm_pairwise |" in markdown
