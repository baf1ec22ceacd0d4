"""The review task's rating model (common/rating_model.py) and every rating source of stage 05
(common/rating_sources.py): the regression target and the pooling over windows on the tiny model, the
metrics of each source on fixed predictions against hand-computed numbers, the blend fitted on the dev
papers only, a paper without a rating left out and counted, and stage 05 end to end with both."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import error_line, run_dir_of, run_stage

from common.data import load_split, one_per_group
from common.metrics import rating_source_metrics
from common.rating_sources import apply_blend, fit_blend, rating_sources

TINY = "configs/tiny/review"
# A rating read back from a saved run (RatingModel.from_run) against the one stage 03 wrote for the same paper, in
# the same batches. On the CPU both are one computation: to float rounding. On a GPU stage 03's process rated its
# dev papers inside the trainer's bf16 autocast with TF32 fp32 matmuls (common.model.precision_flags), 4.4e-4 at
# most from the model read back (an H100, ratings near 3.9); train() now ends both, and the tolerance stays a
# thousandth of a rating point until a GPU run measures the gap again (without the trained adapter: some 0.06 off).
READ_BACK = 1e-3 if torch.cuda.is_available() else 1e-4


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """A review pairs run and a rating model trained on it (tiny model, 2 steps)."""
    out = tmp_path_factory.mktemp("rating_runs")
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", f"{TINY}/01_build_pairs.yaml", "--runs_dir", out))
    rating = run_dir_of(run_stage("03_train_reward.py", "--config", f"{TINY}/03_train_rating.yaml",
                                  "--pairs_run", pairs, "--runs_dir", out))
    return out, pairs, rating


# --- the model -------------------------------------------------------------------------------------

@pytest.mark.stage
@pytest.mark.parametrize("field", [["--topic_gate", "2"], ["--corruptions", "cut"]])
def test_fields_of_a_preference_judge_are_refused_for_a_rating_model(runs, field):
    out, pairs, _ = runs
    line = error_line(run_stage("03_train_reward.py", "--config", f"{TINY}/03_train_rating.yaml", "--pairs_run", pairs,
                                "--runs_dir", out, *field, check=False))
    assert f"field '{field[0][2:]}'" in line and "rating model" in line


def test_pool_mean_and_attention_by_hand():
    from common.rating_model import pool
    logits = torch.tensor([[1.0, 0.0], [3.0, math.log(3)], [-2.0, 5.0]])
    index = torch.tensor([0, 0, 1])
    assert pool(logits, index, 2, "mean").tolist() == pytest.approx([2.0, -2.0])
    # paper 0: weights 1/4 and 3/4 on scores 1 and 3; paper 1: one window
    assert pool(logits, index, 2, "attention").tolist() == pytest.approx([0.25 * 1 + 0.75 * 3, -2.0])


@pytest.mark.stage
def test_the_target_is_the_standardised_mean_rating_of_the_train_papers(runs):
    _, pairs, rating = runs
    scale = json.loads((rating / "rating_scale.json").read_text())
    train = one_per_group(load_split(pairs, "train"))[:6]  # max_train_examples: 6 papers
    means = np.array([np.mean(r["human_ratings"]) for r in train])
    assert scale["mean"] == pytest.approx(means.mean()) and scale["sd"] == pytest.approx(means.std())
    assert scale["n_train_papers"] == 6 and scale["pooling"] == "mean"
    metrics = json.loads((rating / "metrics.json").read_text())
    assert metrics["judge_objective"] == "rating" and metrics["n"] == 4
    for key in ("rating_mae", "rating_rmse", "rating_pearson", "rating_spearman"):
        assert key in metrics
    # the loss the trainer logged is the regression's on those targets: finite, positive
    assert 0 < metrics["train"]["train_loss"] < 10


@pytest.mark.stage
def test_the_test_papers_are_rated_and_reported_beside_dev_never_chosen_on(runs):
    """audit_extra_splits (dev_later, test): the review pairs run has no dev_later; the test papers are rated,
    written and measured against the train mean's MAE, paired over the same papers."""
    _, pairs, rating = runs
    metrics = json.loads((rating / "metrics.json").read_text())
    assert set(metrics["other_splits"]) == {"test"} and metrics["metrics_split"] == "dev"
    written = [json.loads(line) for line in (rating / "test_ratings.jsonl").read_text().splitlines()]
    test = [r for r in one_per_group(load_split(pairs, "test")) if r["human_ratings"]][:4]  # max_eval_examples
    assert [w["id"] for w in written] == [r["group_id"] for r in test]
    gold = np.array([np.mean(r["human_ratings"]) for r in test])
    assert [w["human_rating"] for w in written] == pytest.approx(gold.tolist())
    predicted, mean = np.array([w["predicted"] for w in written]), metrics["rating_scale"]["mean"]
    reported = metrics["other_splits"]["test"]
    assert reported["n"] == len(test) and reported["rating_mae"] == pytest.approx(np.abs(predicted - gold).mean())
    assert reported["mae_minus_constant"] == pytest.approx(np.abs(predicted - gold).mean() - np.abs(mean - gold).mean())
    low, high = reported["mae_minus_constant_ci"]
    assert low <= reported["mae_minus_constant"] <= high
    bow = metrics["baselines"]["bag_of_words"]
    assert bow["dev"]["n"] == metrics["n"] and bow["test"]["n"] == len(test)


@pytest.mark.stage
def test_a_paper_is_its_windows_pooled_and_unstandardised(runs):
    """RatingModel.from_run's rating = mean + sd * the mean of the head's score on each window, each
    window run alone; and it reproduces the dev ratings stage 03 wrote."""
    from common.rating_model import RatingModel, paper_inputs
    _, pairs, rating = runs
    model = RatingModel.from_run(rating)
    device = next(model.model.parameters()).device  # predict moves its batches there; by hand, so do we
    dev = one_per_group(load_split(pairs, "dev"))[:4]  # the papers stage 03 rated (max_eval_examples), in its batches
    windows = [paper_inputs(r, model.tokenizer, model.config, model.kind) for r in dev[:2]]
    assert all(1 < len(w) <= model.config.rating_max_windows for w in windows)  # long papers: several windows
    assert all(len(ids) <= model.config.max_length for w in windows for ids in w)
    by_hand = []
    with torch.no_grad():
        for paper in windows:
            scores = [float(model.model(input_ids=torch.tensor([ids], device=device)).logits[0, 0]) for ids in paper]
            by_hand.append(model.scale["mean"] + model.scale["sd"] * sum(scores) / len(scores))
    predicted = model.predict(dev)
    assert predicted[:2] == pytest.approx(by_hand, abs=2e-2)  # bf16 compute: padded batches round differently
    written = [json.loads(line) for line in (rating / "dev_ratings.jsonl").read_text().splitlines()]
    assert [w["predicted"] for w in written] == pytest.approx(predicted, abs=READ_BACK)


def test_the_encoder_reads_title_abstract_and_introduction():
    from common.rating_model import encoder_text
    row = {"paper": "# T\n\n## Abstract\n\nWe do X.\n\n## 1 Introduction\n\nX matters.\n\n## 2 Method\n\nSecret."}
    assert encoder_text(row) == "# T\n\n## Abstract\n\nWe do X.\n\n## 1 Introduction\n\nX matters."


def test_the_bag_of_words_baseline_finds_a_rating_that_the_words_decide():
    """Papers whose introduction says "excellent" are rated 6, "flawed" 2: the words alone predict the dev and
    test ratings, far better than the train mean."""
    from common.rating_model import BOW_ALPHAS, bag_of_words, encoder_text
    rng = np.random.default_rng(0)
    filler = ["model", "data", "method", "results", "training", "task", "loss", "baseline", "study", "network"]

    def paper(i):
        good = i % 2 == 0
        words = " ".join(rng.choice(filler, 30))
        return {"paper": f"# Paper {i}\n\n## Abstract\n{words}\n\n## 1 Introduction\nThe approach is "
                         f"{'excellent' if good else 'flawed'}. {words}\n\n## 2 Method\nexcellent flawed",
                "human_ratings": [6, 6] if good else [2, 2]}
    rows = [paper(i) for i in range(60)]
    assert "Method" not in encoder_text(rows[0])  # the introduction ends at the next heading
    out = bag_of_words(rows[:40], {"dev": rows[40:50], "test": rows[50:]}, "dev", seed=0)
    assert out["alpha"] in BOW_ALPHAS and out["vocabulary"] > 10
    for split in ("dev", "test"):
        assert out[split]["n"] == 10 and out[split]["rating_spearman"] > 0.8
        assert out[split]["mae_minus_constant_ci"][1] < 0  # clearly better than the train mean (4)


def test_the_bag_of_words_reads_the_whole_paper_when_dev_says_so():
    """The verdict is in the method section, past the introduction: only the whole paper's words carry it,
    and dev picks that text."""
    from common.rating_model import bag_of_words
    rng = np.random.default_rng(1)
    filler = ["model", "data", "method", "results", "training", "task", "loss", "baseline", "study", "network"]

    def paper(i):
        good, words = i % 2 == 0, " ".join(rng.choice(filler, 30))
        return {"paper": f"# Paper {i}\n\n## Abstract\n{words}\n\n## 1 Introduction\n{words}\n\n## 2 Method\n"
                         f"The proof is {'sound' if good else 'wrong'}.", "human_ratings": [6, 5] if good else [2, 3]}
    rows = [paper(i) for i in range(60)]
    out = bag_of_words(rows[:40], {"dev": rows[40:50], "test": rows[50:]}, "dev", seed=0)
    assert out["text"] == "paper" and out["test"]["rating_spearman"] > 0.8


# --- the sources ------------------------------------------------------------------------------------

def test_source_metrics_on_fixed_predictions():
    """pred [4, 3, 5] vs gold [4.5, 3, 4], constant 4: MAE 0.5, RMSE sqrt(1.25/3), Pearson sqrt(3/7),
    Spearman 0.5 (ranks [2, 1, 3] vs [3, 1, 2]); |pred - gold| - |4 - gold| = [0, -1, 1]: mean 0."""
    r = rating_source_metrics([4, 3, 5], [4.5, 3, 4], 4.0, seed=0)
    assert r["rating_mae"] == pytest.approx(0.5) and r["rating_rmse"] == pytest.approx(math.sqrt(1.25 / 3))
    assert r["rating_pearson"] == pytest.approx(math.sqrt(3 / 7)) and r["rating_spearman"] == pytest.approx(0.5)
    assert r["mae_minus_constant"] == pytest.approx(0.0) and r["n"] == 3 and r["n_without_rating"] == 0
    low, high = r["mae_minus_constant_ci"]
    assert -1 <= low <= 0 <= high <= 1
    better = rating_source_metrics([4.5, 3, 4], [4.5, 3, 4], 4.0, seed=0)  # perfect: 0.5 better than the constant
    assert better["mae_minus_constant"] == pytest.approx(-0.5) and better["mae_minus_constant_ci"][1] <= 0 < -better["mae_minus_constant_ci"][0]


def test_a_paper_without_a_rating_is_kept_out_and_counted():
    r = rating_source_metrics([4, None, 3, 5, 2], [4.5, 4, 3, 4, None], 4.0, seed=0)
    assert r["n"] == 3 and r["n_without_rating"] == 2 and r["rating_mae"] == pytest.approx(0.5)
    premises = [{"human_ratings": [4, 5]}, {"human_ratings": []}, {"human_ratings": [3]}]
    out = rating_sources(premises, {"sft": {"parsed": [4, 4, None], "readout": [4.2, 3.9, 3.1],
                                            "rating": [4, 4, 3.1]}}, None, 4.0, seed=0)["sources"]
    assert out["sft_parsed"]["n"] == 1 and out["sft_parsed"]["n_without_rating"] == 2
    assert out["sft_readout"]["n"] == 2 and out["sft_readout"]["n_without_rating"] == 1
    assert out["baseline_constant"]["n_without_rating"] == 1
    assert out["baseline_human"]["n_papers"] == 1 and out["baseline_human"]["n_without_rating"] == 1


def test_the_blend_is_least_squares_on_dev_and_never_sees_the_scored_papers():
    dev = [{"id": f"d{i}", "human_ratings": [g]} for i, g in enumerate([3.0, 4.0, 5.0, 4.5, 2.5])]
    written = [3.5, 4.0, 4.0, 5.0, 3.0]
    model_dev = [3.2, 3.9, 4.8, 4.4, 2.9]
    X = np.column_stack([np.ones(5), written, model_dev])
    want = np.linalg.lstsq(X, [3.0, 4.0, 5.0, 4.5, 2.5], rcond=None)[0]
    extra = {"dev": {"sft": {r["id"]: w for r, w in zip(dev, written)}}, "dev_rows": dev,
             "rating_model_dev": {r["id"]: m for r, m in zip(dev, model_dev)}, "rating_model": [4.1, 3.0]}
    per_model = {"sft": {"parsed": [4, None], "readout": [4.0, 3.3], "rating": [4, 3.3]}}
    fits = []
    for gold in ([4.0, 3.0], [1.0, 6.0]):  # the scored papers' ratings change; the blend must not
        scored = [{"human_ratings": [g]} for g in gold]
        out = rating_sources(scored, per_model, extra, 4.0, seed=0)["sources"]
        fits.append(out["sft_blend"]["blend"])
    assert fits[0] == fits[1]
    b = fits[0]
    assert [b["intercept"], b["weights"]["sft_rating"], b["weights"]["rating_model"]] == pytest.approx(want.tolist())
    assert b["n_fit"] == 5
    expected = np.clip(want[0] + want[1] * np.array([4, 3.3]) + want[2] * np.array([4.1, 3.0]), 1, 6)
    assert apply_blend(b, {"sft_rating": [4, 3.3], "rating_model": [4.1, 3.0]}) == pytest.approx(expected.tolist())


def test_a_source_that_hardly_varies_on_dev_is_left_out_of_the_blend():
    rng = np.random.default_rng(0)
    gold = rng.uniform(2, 5, 40)
    readout = gold + rng.normal(0, 0.5, 40)
    flat = 4.2 + rng.normal(0, 0.02, 40)  # a rating model that says the mean to every paper
    fitted = fit_blend({"readout": list(readout), "model": list(flat)}, list(gold))
    alone = fit_blend({"readout": list(readout)}, list(gold))
    assert set(fitted["weights"]) == {"readout"} and fitted["flat"] == {"model": pytest.approx(np.std(flat))}
    assert fitted["weights"]["readout"] == pytest.approx(alone["weights"]["readout"])
    assert fitted["intercept"] == pytest.approx(alone["intercept"]) and alone["flat"] == {}


def test_the_report_names_a_source_left_out_of_the_blend():
    from common.rating_sources import table_rows
    rng = np.random.default_rng(0)
    gold = 4 + rng.normal(0, 0.5, 40)
    blend = fit_blend({"sft_rating": list(gold + rng.normal(0, 0.3, 40)), "rating_model": [4.2] * 40}, list(gold))
    row = {"rating_mae": 0.4, "n": 40, "blend": blend}
    line = [r for r in table_rows({"sft_blend": row}) if r.startswith("\nsft_blend =")]
    assert len(line) == 1 and "x sft_rating" in line[0] and "x rating_model" not in line[0]
    assert "rating_model left out, sd 0.000 on dev" in line[0]
    alone = fit_blend({"rating_model": [4.2] * 40}, list(gold))  # every source flat: the intercept alone
    line = table_rows({"sft_blend": {**row, "blend": alone}})[-1]
    assert line.startswith(f"\nsft_blend = {alone['intercept']:.3f} (fitted on 40 dev papers; rating_model left out")


def test_a_blend_with_fewer_dev_papers_than_weights_is_refused():
    from common.runs import RunError
    with pytest.raises(RunError, match="3 weights but only 1 dev papers"):
        fit_blend({"a": [1.0, 2.0], "b": [3.0, None]}, [1.0, 2.0])


# --- stage 05 ------------------------------------------------------------------------------------

@pytest.mark.stage
def test_stage_05_reports_every_rating_source(runs):
    out, pairs, rating = runs
    common = ["--config", f"{TINY}/05_eval.yaml", "--pairs_run", pairs, "--runs_dir", out, "--max_new_tokens", "8"]
    dev = run_dir_of(run_stage("05_eval.py", *common, "--split", "dev", "--max_premises", "5"))
    proc = run_stage("05_eval.py", *common, "--max_premises", "3", "--rating_run", rating, "--rating_dev_run", dev)
    evalrun = run_dir_of(proc)
    sources = json.loads((evalrun / "eval.json").read_text())["rating_sources"]
    assert set(sources) == {"base_parsed", "base_readout", "rating_model", "bag_of_words", "baseline_constant",
                            "base_blend", "baseline_human"}
    assert sources["rating_model"]["n"] == 3 and "rating_spearman_ci" in sources["rating_model"]
    # the bag of words of the rating run, refitted on its train papers, rates as stage 03 measured it on dev
    from common.rating_model import BagOfWords, papers
    bow, alpha = BagOfWords.of_run(rating)
    stage03 = json.loads((rating / "metrics.json").read_text())["baselines"]["bag_of_words"]
    assert alpha == stage03["alpha"] and bow.text == stage03["text"]
    assert rating_source_metrics(bow.predict(papers(pairs, "dev", 4), alpha), [np.mean(r["human_ratings"]) for r in
                                 papers(pairs, "dev", 4)], bow.train_mean, 42)["rating_mae"] == \
        pytest.approx(stage03["dev"]["rating_mae"])
    assert sources["bag_of_words"]["n"] == 3
    assert sources["base_blend"]["blend"]["n_fit"] == 5
    blend = sources["base_blend"]["blend"]  # a source that hardly varies on the dev papers is left out, named
    assert set(blend["weights"]) | set(blend["flat"]) == {"base_rating", "rating_model", "bag_of_words"}
    assert not set(blend["weights"]) & set(blend["flat"]) and all(sd < 0.1 for sd in blend["flat"].values())
    for name in sources:
        assert (evalrun / f"rating_{name}_scatter.png").is_file()
    assert "## Every rating source" in (evalrun / "report.md").read_text()
    # without a dev run: every source but the blend, which needs the dev papers
    alone = run_dir_of(run_stage("05_eval.py", *common, "--max_premises", "3", "--rating_run", rating))
    sources = json.loads((alone / "eval.json").read_text())["rating_sources"]
    assert {"rating_model", "bag_of_words"} <= set(sources) and not any(name.endswith("_blend") for name in sources)
    assert sources["bag_of_words"]["n"] == 3
    # a test-split run is no dev run for the blend: one error line, before anything is generated
    bad = run_stage("05_eval.py", *common, "--max_premises", "3", "--rating_dev_run", evalrun, check=False)
    assert bad.returncode != 0 and "the blend is fitted on the dev papers" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_rerank_keeps_the_review_whose_rating_is_nearest_the_rating_models():
    from common.rating_sources import rerank_by_rating
    sampled = ["Overall Quality: 2", "Overall Quality: 4", "no rating",  # paper 1, rating model 4.4
               "loops", "loops again", "Overall Quality: 6"]  # paper 2, rating model 3.0
    kept, info = rerank_by_rating(sampled, 3, [4.4, 3.0])
    assert kept == ["Overall Quality: 4", "Overall Quality: 6"]
    assert info[0] == {"candidate_ratings": [2.0, 4.0, None], "kept": 1, "rating_model": 4.4}
    assert rerank_by_rating(["a", "b"], 2, [4.0])[0] == ["a"]  # none writes a rating: the first


def test_the_rerank_reports_how_far_its_written_rating_follows_the_rating_model():
    from common.rating_sources import agreement_rows, rerank_agreement
    info = [{"candidate_ratings": [3.0, 5.0], "kept": 0, "rating_model": 3.2},   # kept 3.0, gap 0.2
            {"candidate_ratings": [4.0, 4.0], "kept": 1, "rating_model": 4.0},   # kept 4.0, gap 0
            {"candidate_ratings": [None, 6.0], "kept": 1, "rating_model": 5.0},  # kept 6.0, gap 1; one candidate
            {"candidate_ratings": [None, None], "kept": 0, "rating_model": 4.5}]  # none written: kept out, counted
    a = rerank_agreement(info)
    assert a["n"] == 3 and a["n_without_rating"] == 1 and a["mean_abs_gap"] == pytest.approx(0.4)
    assert a["pearson_with_rating_model"] == pytest.approx(np.corrcoef([3, 4, 6], [3.2, 4, 5])[0, 1])
    assert a["candidates_sd_within_paper"] == pytest.approx(0.5)  # papers with two written: sd 1 and 0
    assert a["rating_model_sd"] == pytest.approx(np.std([3.2, 4.0, 5.0, 4.5]))
    assert "Pearson 0.99, mean gap 0.40" in agreement_rows(a)[1]
    flat = rerank_agreement([{**row, "rating_model": 4.0} for row in info])  # a rating model that never varies
    assert flat["pearson_with_rating_model"] is None and "Pearson n/a" in agreement_rows(flat)[1]


def test_a_hinted_eval_reports_how_far_each_model_writes_the_rating_it_was_told():
    from common.rating_sources import hint_agreement, hint_rows
    hints = [3.6, 4.0, 4.3, 4.1]
    # one writes the hint (4.0), the others 4.5 or nothing; its read-out follows the hints exactly
    a = hint_agreement(hints, [4.5, 4.0, 4.5, None], [3.6, 4.0, 4.3, 4.1])
    assert a["writes_the_hint"] == 1 and a["n"] == 3 and a["n_without_rating"] == 1
    assert a["mean_abs_gap"] == pytest.approx((0.9 + 0 + 0.2) / 3)
    assert a["pearson_with_rating_model"] == pytest.approx(np.corrcoef([4.5, 4.0, 4.5], [3.6, 4.0, 4.3])[0, 1])
    assert a["readout_pearson_with_hint"] == pytest.approx(1.0)
    assert a["written_sd"] == pytest.approx(np.std([4.5, 4.0, 4.5])) and a["hint_sd"] == pytest.approx(np.std(hints))
    # a model that writes one rating everywhere and has no read-out: no Pearson, said as n/a
    flat = hint_agreement(hints, [4.5] * 4, [None] * 4)
    assert flat["pearson_with_rating_model"] is None and flat["readout_pearson_with_hint"] is None
    line = hint_rows({"sft": flat})[-1]
    assert line.startswith("- sft: writes it in 0 of 4 reviews") and "read-out's Pearson with it n/a" in line


@pytest.mark.stage
def test_stage_05_reranks_sft_reviews_by_the_rating_model(runs):
    out, pairs, rating = runs
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", f"{TINY}/02_train_sft.yaml", "--pairs_run", pairs,
                               "--runs_dir", out, "--max_steps", "1"))
    common = ["--config", f"{TINY}/05_eval.yaml", "--pairs_run", pairs, "--runs_dir", out, "--max_new_tokens", "8",
              "--sft_run", sft]
    dev = run_dir_of(run_stage("05_eval.py", *common, "--split", "dev", "--max_premises", "4", "--evaluate_base", "false"))
    evalrun = run_dir_of(run_stage("05_eval.py", *common, "--max_premises", "2", "--rating_run", rating,
                                   "--rating_dev_run", dev, "--rerank_by_rating", "2"))
    results = json.loads((evalrun / "eval.json").read_text())
    assert {"sft", "rerank_by_rating"} <= set(results) and "rerank_by_rating_readout" in results["rating_sources"]
    # the dev run evaluated the same SFT run (not the base): SFT's blend only, fitted on its 4 dev papers
    assert "sft_blend" in results["rating_sources"] and "base_blend" not in results["rating_sources"]
    assert results["rating_sources"]["sft_blend"]["blend"]["n_fit"] == 4
    assert results["rerank_by_rating"]["n"] == 2 and "bleu4" in results["rerank_by_rating"]
    rows = [json.loads(line) for line in (evalrun / "replies.jsonl").read_text().splitlines()]
    assert all(len(r["rerank_by_rating"]["candidate_ratings"]) == 2 for r in rows)
    agreement = results["rerank_by_rating"]["agreement"]
    assert agreement["n"] + agreement["n_without_rating"] == 2
    assert "*rerank_by_rating*: its written rating against the rating model's" in (evalrun / "report.md").read_text()


@pytest.mark.stage
def test_a_writer_trained_on_a_hinted_rating_is_evaluated_with_the_rating_models(runs):
    out, pairs, rating = runs
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", f"{TINY}/02_train_sft.yaml", "--pairs_run", pairs,
                               "--runs_dir", out, "--max_steps", "1", "--rating_hint_noise", "0.4"))
    common = ["--config", f"{TINY}/05_eval.yaml", "--pairs_run", pairs, "--runs_dir", out, "--max_new_tokens", "8",
              "--sft_run", sft, "--max_premises", "2"]
    # without a rating model there is no rating to put in the prompt: one error line, before anything is generated
    bad = run_stage("05_eval.py", *common, check=False)
    assert bad.returncode != 0 and "give --rating_run" in error_line(bad) and "Traceback" not in bad.stderr
    evalrun = run_dir_of(run_stage("05_eval.py", *common, "--rating_run", rating))
    manifest = json.loads((evalrun / "manifest.json").read_text())
    assert manifest["rating_hint"] == {"from": str(rating), "sft_rating_hint_noise": 0.4}
    # the prompts that were answered say the rating model's rating of each paper
    from common.config import load_run_config
    from common.rating_sources import hinted_premises, rating_inputs
    from common.tasks.review_text import HINT
    config = load_run_config(evalrun)
    premises = one_per_group(load_split(pairs, "test"))[:2]
    extra = rating_inputs(config, None, premises)
    hinted = hinted_premises(config, SimpleNamespace(manifest={}), premises, extra)
    for row, value in zip(hinted, extra["rating_model"]):
        assert HINT.format(round(value, 1)) in row["prompt"][0]["content"] and row["rating_hint"] == round(value, 1)
    rows = [json.loads(line) for line in (evalrun / "replies.jsonl").read_text().splitlines()]
    assert [r["sft"]["rating_model"] for r in rows] == pytest.approx(extra["rating_model"], abs=READ_BACK)
    # and how far each model wrote the rating it was told, in eval.json and under report.md's table
    results = json.loads((evalrun / "eval.json").read_text())
    for name in ("base", "sft"):
        assert results[name]["hint"]["n"] + results[name]["hint"]["n_without_rating"] == 2
    assert "*Told the rating model's rating*" in (evalrun / "report.md").read_text()
    # its preference stage would train on prompts without the rating: refused
    dpo = run_stage("04_train_dpo.py", "--config", f"{TINY}/04_train_dpo.yaml", "--sft_run", sft, "--runs_dir", out,
                    check=False)
    assert dpo.returncode != 0 and "rating_hint_noise" in error_line(dpo) and "Traceback" not in dpo.stderr


@pytest.mark.stage
def test_stage_05_takes_a_rating_model_of_another_family(runs, tmp_path):
    """A writer and its rating model need not share a base (the qwen-gpu chain may keep SmolLM2's rating model
    beside the Qwen writer, where dev prefers it): 05 loads the rating model on its own base and records which."""
    from conftest import tiny_arch
    out, pairs, _ = runs
    rating = run_dir_of(run_stage("03_train_reward.py", "--config", f"{TINY}/03_train_rating.yaml", "--pairs_run", pairs,
                                  "--runs_dir", out, "--model_name_or_path", tiny_arch(tmp_path, "qwen2")))
    evalrun = run_dir_of(run_stage("05_eval.py", "--config", f"{TINY}/05_eval.yaml", "--pairs_run", pairs, "--runs_dir",
                                   out, "--max_new_tokens", "8", "--max_premises", "2", "--rating_run", rating))
    manifest = json.loads((evalrun / "manifest.json").read_text())
    theirs = json.loads((rating / "manifest.json").read_text())["base"]
    assert manifest["inputs"]["rating_run"]["base"] == theirs and theirs != manifest["base"]
    assert json.loads((evalrun / "eval.json").read_text())["rating_sources"]["rating_model"]["n"] == 2


@pytest.mark.stage
@pytest.mark.parametrize("variant", [["--config", f"{TINY}/03_train_rating_minilm.yaml"],
                                     ["--config", f"{TINY}/03_train_rating.yaml", "--rating_pooling", "attention"]],
                         ids=["minilm_encoder", "attention_pooling"])
def test_the_encoder_and_attention_pooling_rate_as_stage_03_measured(runs, variant):
    """The MiniLM baseline (one input a paper, early stopping on dev) and attention pooling (a head of two
    outputs) are saved and read back to the dev ratings stage 03 wrote."""
    from common.model import unwrap_peft
    from common.rating_model import RatingModel
    out, pairs, _ = runs
    run = run_dir_of(run_stage("03_train_reward.py", *variant, "--pairs_run", pairs, "--runs_dir", out))
    model = RatingModel.from_run(run)
    head = unwrap_peft(model.model).config.num_labels
    assert head == (2 if "attention" in variant else 1)
    dev = one_per_group(load_split(pairs, "dev"))[:4]
    written = [json.loads(line)["predicted"] for line in (run / "dev_ratings.jsonl").read_text().splitlines()]
    assert model.predict(dev) == pytest.approx(written, abs=READ_BACK)
    metrics = json.loads((run / "metrics.json").read_text())
    assert ("early_stopping" in metrics) == ("attention" not in variant)
