"""Stage 05's numbers and plots, and the stage-04 watch statistics, on synthetic inputs whose answer
is known: a judge that only counts words must lose its edge once length is controlled for; rating metrics
and baselines match numbers worked out by hand."""
from __future__ import annotations

import numpy as np
import pytest

from common.metrics import baseline_constant, baseline_human, length_controlled_win_rate, rating_metrics, win_rate
from common.report import plot_distributions, write_report
from common.watch import distinct_n, premise_overlap


def _premises(n):
    return [{"premise": f"CMV: claim {i}\n\nbody {i}", "chosen": f"winning reply {i}"} for i in range(n)]


def test_length_controlled_win_rate_removes_a_pure_length_preference():
    rng = np.random.default_rng(0)
    base_len = rng.integers(40, 120, 200)
    model_len = (base_len * rng.uniform(0.6, 2.5, 200)).astype(int)  # mostly longer
    judge = lambda words: words + rng.normal(0, 1, len(words))      # noqa: E731  only counts words
    scores, base_scores = judge(model_len), judge(base_len)
    plain = win_rate(scores, base_scores, seed=0)["win_rate_vs_base"]
    lc = length_controlled_win_rate(scores, base_scores, model_len, base_len, seed=0)
    assert plain > 0.65                                   # the plain win rate is fooled by length
    low, high = lc["lc_win_rate_vs_base_ci95"]
    assert low <= 0.5 <= high and abs(lc["lc_win_rate_vs_base"] - 0.5) < 0.1
    assert lc["length_coef"] > 1                          # and the judge's length effect is measured


def test_length_controlled_win_rate_keeps_a_real_preference():
    rng = np.random.default_rng(1)
    base_len = rng.integers(40, 120, 200)
    model_len = (base_len * rng.uniform(0.5, 2.0, 200)).astype(int)
    better = rng.random(200) < 0.8                          # wins 80%, whatever the lengths
    scores, base_scores = better.astype(float), (~better).astype(float)
    lc = length_controlled_win_rate(scores, base_scores, model_len, base_len, seed=0)
    assert 0.7 < lc["lc_win_rate_vs_base"] < 0.9
    assert lc["lc_win_rate_vs_base_ci95"][0] > 0.65
    assert abs(lc["length_coef"]) < 1


def test_base_against_itself_is_even():
    scores, words = [0.1, 0.3, -0.2, 0.5], [10, 20, 30, 40]
    lc = length_controlled_win_rate(scores, scores, words, words)
    assert lc["lc_win_rate_vs_base"] == pytest.approx(0.5) and lc["lc_win_rate_vs_base_ci95"] == [0.5, 0.5]


def test_plots_are_pngs_and_embedded_in_the_report(tmp_path):
    replies = {"base": ["short reply"] * 3 + ["a somewhat longer reply here"],
               "grpo": ["much longer reply " * 5] * 4}
    rewards = {"base": [0.1, 0.2, 0.0, 0.3], "grpo": [0.5, 0.4, 0.6, 0.7]}
    plots = plot_distributions(tmp_path, replies, rewards)
    assert len(plots) == 2
    for path in plots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
    results = {name: {"reward_mean": float(np.mean(r)), "win_rate_vs_base": 0.5, "win_rate_vs_base_ci95": [0.4, 0.6],
                      "lc_win_rate_vs_base": 0.5, "lc_win_rate_vs_base_ci95": [0.3, 0.7], "bleu4": 0.0,
                      "rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0, "reply_words_mean": 3.0} for name, r in rewards.items()}
    from common.tasks import cmv
    report = write_report(tmp_path / "report.md", "Nov30_Eval_Run1", results, _premises(4), replies, rewards, 2,
                          plots, "The judge falls for pad_loser_filler.", display=cmv.display, nouns=cmv.NOUNS)
    text = report.read_text()
    for path in plots.values():
        assert f"]({path.name})" in text
    assert "LC win rate" in text and "0.50 [0.30, 0.70]" in text and "falls for pad_loser_filler" in text


def test_watch_statistics():
    assert distinct_n(["a b c d", "e f g h"]) == 1.0
    assert distinct_n(["a b a b a b"] * 4) == pytest.approx(2 / 20)     # a collapsed, repetitive batch
    premise = "school uniforms should be mandatory because they reduce bullying"
    assert premise_overlap(premise, premise) == 1.0                   # an echo
    assert premise_overlap(premise, "I disagree, freedom of expression matters more") == 0.0


# --- ratings (review) --------------------------------------------------------------------------------

def test_rating_metrics_and_baselines_by_hand():
    # errors -0.5, 0, 1: MAE 1.5/3; RMSE sqrt(1.25/3); deviations (0, -1, 1) and (2/3, -5/6, 1/6):
    # covariance sum 1, squares 2 and 7/6, so r = 1 / sqrt(2 * 7/6) = sqrt(3/7)
    # Spearman: ranks (2, 1, 3) and (3, 1, 2), deviations (0, -1, 1) and (1, -1, 0): rho = 1 / 2
    got = rating_metrics([4, 3, 5], [4.5, 3.0, 4.0])
    assert got == pytest.approx({"rating_mae": 0.5, "rating_rmse": 0.6454972, "rating_pearson": 0.6546537,
                                 "rating_spearman": 0.5, "n": 3})
    # always 4.0: errors 0.5, 1, 0; a constant prediction has no correlation
    got = baseline_constant(4.0, [4.5, 3.0, 4.0])
    assert got.pop("rating_pearson") is None and got.pop("rating_spearman") is None
    assert got == pytest.approx({"rating_mae": 0.5, "rating_rmse": 0.6454972, "n": 3})
    # paper 1: 4 vs 2, 2 vs 4; paper 2: 3 vs 4.5, 4 vs 4, 5 vs 3.5; paper 3 (one reviewer) left out.
    # errors 2, 2, 1.5, 0, 1.5: MAE 7/5; RMSE sqrt(12.5/5); deviations from 3.6 (0.4, -1.6, -0.6, 0.4, 1.4)
    # and (-1.6, 0.4, 0.9, 0.4, -0.1): covariance sum -1.8, squares 5.2 and 3.7, r = -1.8 / sqrt(19.24).
    # Spearman: ranks (3.5, 1, 2, 3.5, 5) and (1, 3.5, 5, 3.5, 2), deviations from 3 give a covariance
    # sum of -5.75 and squares 9.5 and 9.5: rho = -5.75 / 9.5
    got = baseline_human([[4, 2], [3, 4, 5], [6]])
    assert got == pytest.approx({"rating_mae": 1.4, "rating_rmse": 1.5811388, "rating_pearson": -0.4103646,
                                 "rating_spearman": -5.75 / 9.5, "n": 5, "n_papers": 2})


def test_rating_metrics_edge_cases():
    assert rating_metrics([], []) == {"rating_mae": None, "rating_rmse": None, "rating_pearson": None,
                                             "rating_spearman": None, "n": 0}
    assert rating_metrics([4], [3])["rating_pearson"] is None
    assert rating_metrics([4.2, 4.2, 4.2], [1, 2, 3])["rating_pearson"] is None
    with pytest.raises(ValueError):
        rating_metrics([1, 2], [1])
