"""The paper-review task through the real command lines on the tiny recipe: 01 -> 02 -> 04_train_dpo
-> 05, every paper and review accounted for, SFT windows within max_length and covering the paper,
and the rating metrics with both baselines in eval.json."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_dir_of, run_stage

from common.data import load_split
from common.tasks import review, review_text

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)

TINY = "configs/tiny/review"


@pytest.fixture(scope="module")
def chain(tiny_model, tmp_path_factory) -> dict:
    runs = tmp_path_factory.mktemp("review")
    common = ["--runs_dir", runs]
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", f"{TINY}/01_build_pairs.yaml", *common))
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", f"{TINY}/02_train_sft.yaml", "--pairs_run", pairs,
                               *common))
    dpo = run_dir_of(run_stage("04_train_dpo.py", "--config", f"{TINY}/04_train_dpo.yaml", "--sft_run", sft, *common))
    proc = run_stage("05_eval.py", "--config", f"{TINY}/05_eval.yaml", "--pairs_run", pairs, "--sft_run", sft,
                     "--policy_runs", dpo, *common)
    return {"pairs": pairs, "sft": sft, "dpo": dpo, "eval": run_dir_of(proc), "runs": runs}


def test_every_paper_and_review_is_accounted_for_and_split_by_paper(chain):
    metrics = json.loads((chain["pairs"] / "metrics.json").read_text())
    assert metrics["task"] == "review" and metrics["n_input_rows"] == 400
    assert metrics["n_rows_used"] + sum(metrics["dropped"].values()) == metrics["n_input_rows"]
    units = metrics["input_units"]
    assert units["n_reviews"] + units.get("n_reviews_in_dropped_rows", 0) == 1612
    papers = {split: {row["group_id"] for row in load_split(chain["pairs"], split)} for split in ("train", "dev", "test")}
    assert not (papers["train"] & papers["dev"] or papers["train"] & papers["test"] or papers["dev"] & papers["test"])
    assert sum(map(len, papers.values())) == metrics["n_rows_used"]


def test_per_review_targets_are_one_per_review_with_its_own_rating(tmp_path, tiny_model):
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", f"{TINY}/01_build_pairs.yaml",
                                 "--review_target", "per_review", "--runs_dir", tmp_path))
    rows = [row for split in ("train", "dev", "test") for row in load_split(pairs, split)]
    assert len(rows) == 1612
    for row in rows[:200]:
        assert review_text.parse_review(row["chosen"])["overall"] == row["rating"] and row["rating"] in row["human_ratings"]


@pytest.mark.parametrize("strategy", ["sliding_window", "whole"])
def test_sft_examples_fit_max_length_and_windows_cover_the_paper(chain, strategy):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(".cache/models/tiny-llama3")
    config = SimpleNamespace(max_length=4096, window_overlap=64, input_strategy=strategy)
    row = load_split(chain["pairs"], "train")[0]
    examples = review.sft_examples(row, tokenizer, config)
    for example in examples:
        ids = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=True)
        assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) <= config.max_length
        assert example["completion"][0]["content"] == row["chosen"]  # the whole target, every window
    papers = [e["prompt"][0]["content"][len(review_text.INSTRUCTION):] for e in examples]
    assert row["paper"].startswith(papers[0][:200])
    if strategy == "whole":
        assert len(examples) == 1
    else:
        assert len(examples) > 1 and row["paper"].rstrip().endswith(papers[-1].rstrip()[-200:])
        for before, after in zip(papers, papers[1:]):  # neighbours share text: no token is skipped
            assert after[:40] in before


def test_a_hinted_writer_trains_on_a_noisy_rating_in_every_window(chain):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(".cache/models/tiny-llama3")
    config = SimpleNamespace(max_length=4096, window_overlap=64, input_strategy="sliding_window", seed=42,
                             rating_hint_noise=0.4)
    rows = load_split(chain["pairs"], "train")[:30]
    hints = [review.training_hint(row, config) for row in rows]
    assert hints == [review.training_hint(row, config) for row in rows]  # the same for a paper at every call
    gaps = [h - row["rating"] for h, row in zip(hints, rows)]
    assert all(1 <= h <= 6 and round(h, 1) == h for h in hints) and 0.15 < float(np.std(gaps)) < 0.8
    assert review.training_hint(rows[0], SimpleNamespace(**{**vars(config), "rating_hint_noise": 0.0})) == \
        round(rows[0]["rating"], 1)
    assert review.training_hint(rows[0], SimpleNamespace(**{**vars(config), "rating_hint_noise": None})) is None
    examples = review.sft_examples(rows[0], tokenizer, config)
    line = review_text.HINT.format(hints[0])
    assert len(examples) > 1 and all(line in e["prompt"][0]["content"] for e in examples)
    for example in examples:  # the hint's tokens are budgeted: every window still fits
        ids = tokenizer.apply_chat_template(example["prompt"] + example["completion"], tokenize=True)
        assert len(ids["input_ids"] if hasattr(ids, "keys") else ids) <= config.max_length


def test_dpo_rejected_reviews_come_from_the_named_model(chain):
    manifest = json.loads((chain["dpo"] / "manifest.json").read_text())
    saved = [json.loads(line) for line in (chain["dpo"] / "rejected.jsonl").read_text().splitlines()]
    assert manifest["rejected_from"] == "sft" and saved and {s["model"] for s in saved} == {"sft"}


def test_eval_has_rating_metrics_and_both_baselines(chain):
    results = json.loads((chain["eval"] / "eval.json").read_text())
    assert {"base", "sft", "dpo", "baseline_constant", "baseline_human"} <= set(results)
    for name in ("base", "sft", "dpo"):
        r = results[name]
        for key in ("rating_mae", "rating_rmse", "rating_pearson", "bleu4", "rouge1", "rouge2", "rougeL"):
            assert key in r, (name, key)
        assert 0 <= r["format_compliance"] <= 1
        assert len(r["unparsed"]) == r["n"] - r["n_rated"]  # unparseable reviews are listed, never dropped
    for baseline in ("baseline_constant", "baseline_human"):
        assert results[baseline]["rating_mae"] >= 0 and results[baseline]["n"] > 0
    report = (chain["eval"] / "report.md").read_text()
    assert "## Ratings" in report and "first window" in report and (chain["eval"] / "rating_scatter.png").is_file()


def test_a_paper_without_text_is_read_from_its_pdf(tmp_path, tiny_model):
    import gzip

    from tasks.test_review import _pdf
    with gzip.open("data/review/neurips2025_papers_reviews.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(40), f)]
    rows[0]["paper_markdown_main"] = ""  # this paper comes without text; its PDF has it
    pdf = tmp_path / f"{rows[0]['paper_id']}.pdf"
    pdf.write_bytes(_pdf(["Attention over long documents in linear time.", "We prove a bound."]))
    data = tmp_path / "papers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--config", f"{TINY}/01_build_pairs.yaml", "--data", data, "--runs_dir", tmp_path / "runs"]
    without = run_stage("01_build_pairs.py", *common, "--run_name", "no_pdf")
    assert json.loads((run_dir_of(without) / "metrics.json").read_text())["dropped"] == {"no_paper_text": 1}
    pairs = run_dir_of(run_stage("01_build_pairs.py", *common, "--pdf", pdf))
    (row,) = [r for s in ("train", "dev", "test") for r in load_split(pairs, s) if r["group_id"] == rows[0]["paper_id"]]
    assert "Attention over long documents in linear time." in row["paper"] and "We prove a bound." in row["paper"]


def test_a_setting_the_rating_model_cannot_work_with_is_refused_on_review_pairs(chain):
    """Stage 03 on review pairs trains a rating model (tests/test_review_rating_model.py), which batches
    whole papers: packing replies padding-free is refused in one line, before any run directory."""
    proc = run_stage("03_train_reward.py", "--config", f"{TINY}/03_train_rating.yaml", "--pairs_run",
                     chain["pairs"], "--runs_dir", chain["runs"], "--padding_free", "true", check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "field 'padding_free': the review task's rating model batches whole papers" in \
        proc.stderr.strip().splitlines()[-1]


BUNDLED = "data/review/neurips2025_papers_reviews.jsonl.gz"


def test_eval_data_scores_another_file_of_papers_each_with_a_rating(chain, tmp_path):
    import gzip
    import hashlib
    held_out = {row["group_id"] for row in load_split(chain["pairs"], "test")}
    with gzip.open(BUNDLED, "rt", encoding="utf-8") as f:  # papers the pairs run never trained on, in a file of their own
        rows = [row for row in map(json.loads, f) if row["paper_id"] in held_out][:3]
    papers = tmp_path / "other_papers.jsonl"
    papers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = run_dir_of(run_stage("05_eval.py", "--config", f"{TINY}/05_eval.yaml", "--pairs_run", chain["pairs"],
                               "--sft_run", chain["sft"], "--eval_data", papers, "--runs_dir", chain["runs"]))
    replies = [json.loads(line) for line in (run / "replies.jsonl").read_text().splitlines()]
    assert [r["id"] for r in replies] == [r["paper_id"] for r in rows]
    for row in replies:
        for model in ("base", "sft"):  # parsed or read out: every paper gets a rating
            assert 1 <= row[model]["rating"] <= 6 and row[model]["rating_source"] in ("parsed", "readout")
    results = json.loads((run / "eval.json").read_text())
    assert results["sft"]["all_papers"]["n"] == 3 and results["baseline_human"]["n"] > 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["eval_data[0]"] == {"path": str(papers.resolve()),
                                                  "sha256": hashlib.sha256(papers.read_bytes()).hexdigest()}
    assert manifest["eval_data"]["files"][0]["n_rows_used"] == 3 and manifest["eval_data"]["n_scored"] == 3
    assert f"`{papers.resolve()}`" in (run / "report.md").read_text()


def test_eval_data_refuses_the_bundled_file_for_overlap_or_drops_and_counts_it(chain):
    trained = {row["group_id"] for split in ("train", "dev") for row in load_split(chain["pairs"], split)}
    held_out = {row["group_id"] for row in load_split(chain["pairs"], "test")}
    args = ["--config", f"{TINY}/05_eval.yaml", "--pairs_run", chain["pairs"], "--sft_run", chain["sft"],
            "--eval_data", BUNDLED, "--evaluate_base", "false", "--max_premises", "2", "--runs_dir", chain["runs"]]
    proc = run_stage("05_eval.py", *args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: {BUNDLED}: {len(trained)} of its 400 rows are papers of the pairs run's train, "
                           f"dev or dev_later split"), line
    run = run_dir_of(run_stage("05_eval.py", *args, "--skip_overlap", "true"))
    data = json.loads((run / "manifest.json").read_text())["eval_data"]
    (counts,) = data["files"]
    assert counts["dropped"]["overlap_train_dev"] == len(trained)
    assert counts["n_rows_used"] + sum(counts["dropped"].values()) == counts["n_input_rows"] == 400
    assert data["n_premises"] == len(held_out) and data["n_scored"] == 2
    replies = [json.loads(line) for line in (run / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 2 and {r["id"] for r in replies} <= held_out


def test_replies_read_back_from_a_review_eval_give_its_ratings_again(chain):
    # --replies_from's reading (scored by a judge, which the review task has none of yet): each model's
    # reviews and read-out ratings come back as written, so the rating metrics come out the same
    from common.data import one_per_group
    from common.eval_inputs import read_replies
    from common.runs import check_input
    source = chain["eval"]
    run = SimpleNamespace(config=SimpleNamespace(replies_from=str(source)), manifest={"inputs": {}},
                          inputs={"replies_from": check_input("replies_from", source)})
    premises = one_per_group(load_split(chain["pairs"], "test"))[:4]
    replies, readouts, _, _ = read_replies(run, premises, review)
    results = review.evaluate(premises, replies, train=load_split(chain["pairs"], "train"), readouts=readouts,
                              rating=None, seed=42).metrics
    saved = json.loads((source / "eval.json").read_text())
    assert set(replies) == {"base", "sft", "dpo"}
    for name in replies:
        assert results[name]["all_papers"] == saved[name]["all_papers"] and run.manifest["replies_from"]["models"]
