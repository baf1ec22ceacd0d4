"""Metrics: judge quality on preference pairs, text overlap, win rates (plain and length-controlled),
ratings against the reviewers' (review), with bootstrap intervals."""
from __future__ import annotations

import numpy as np
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU
from scipy.stats import spearmanr

from common.data import length_only_accuracy, n_words


def wins(scores, other_scores) -> np.ndarray:
    """1 where a score beats the other, 0.5 on a tie, 0 else (pairwise accuracy, win rates)."""
    a, b = np.asarray(scores, float), np.asarray(other_scores, float)
    return (a > b) + 0.5 * (a == b)


def bootstrap_ci(values, n_boot: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    values = np.asarray(values, float)
    if len(values) == 0:
        return [float("nan"), float("nan")]
    rng = np.random.default_rng(seed)
    boot = values[rng.integers(0, len(values), size=(n_boot, len(values)))].mean(axis=1)
    return [float(x) for x in np.percentile(boot, [2.5, 97.5])]


def preference_metrics(pairs: list[dict], chosen_scores: list[float], rejected_scores: list[float],
                       seed: int = 0) -> dict:
    """How well a judge separates winners from losers (ties half), and how much it just counts words."""
    chosen, rejected = np.asarray(chosen_scores, float), np.asarray(rejected_scores, float)
    lengths = [n_words(p["chosen"]) for p in pairs] + [n_words(p["rejected"]) for p in pairs]
    rho = spearmanr(np.concatenate([chosen, rejected]), lengths).statistic if len(pairs) > 1 else None
    correct = wins(chosen, rejected)
    return {
        "n_pairs": len(pairs),
        "accuracy": float(correct.mean()) if len(pairs) else None,
        "accuracy_ci95": bootstrap_ci(correct, seed=seed),
        "mean_margin": float(np.mean(chosen - rejected)) if len(pairs) else None,
        "length_only_accuracy": length_only_accuracy(pairs),
        "score_length_spearman": None if rho is None or np.isnan(rho) else float(rho),
    }


def text_metrics(hypotheses: list[str], references: list[list[str]]) -> dict:
    """Overlap with the real replies, each hypothesis against all of its references: corpus BLEU-4
    (sacrebleu, 0-100; `bleu` and `bleu4` are the same number) and ROUGE-1/2/L F1 (0-1, the best
    reference per hypothesis, averaged). A premise with fewer references repeats its last one, which
    changes no n-gram clip and no closest length, so BLEU is that of its own references."""
    if not hypotheses:
        return {"bleu": 0.0, "bleu4": 0.0, "rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    width = max(len(refs) for refs in references)
    streams = [[refs[min(i, len(refs) - 1)] for refs in references] for i in range(width)]
    score = float(BLEU().corpus_score(hypotheses, streams).score)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    best = [scorer.score_multi(refs, hyp) for hyp, refs in zip(hypotheses, references)]
    return {"bleu": score, "bleu4": score,
            **{k: float(np.mean([b[k].fmeasure for b in best])) for k in ("rouge1", "rouge2", "rougeL")}}


def judge_metrics(scores, base_scores, lengths, base_lengths, seed: int = 0, against: str = "base") -> dict:
    """What a judge says of one model against another (the base, or `against`, e.g. sft): its mean
    reward, and its win rate and length-controlled win rate vs the other, with intervals; the keys
    name the other (`win_rate_vs_base`, `win_rate_vs_sft`, ...)."""
    out = {"reward_mean": float(np.mean(scores)) if len(scores) else None, **win_rate(scores, base_scores, seed=seed),
           **length_controlled_win_rate(scores, base_scores, lengths, base_lengths, seed=seed)}
    return out if against == "base" else {k.replace("vs_base", f"vs_{against}"): v for k, v in out.items()
                                          if "vs_base" in k}


def win_rate(scores: list[float], base_scores: list[float], n_boot: int = 2000, seed: int = 0) -> dict:
    """Share of premises where the model's reply out-scores the base's (ties count half), with a
    95% percentile bootstrap interval over premises."""
    won = wins(scores, base_scores)
    return {"win_rate_vs_base": float(won.mean()), "win_rate_vs_base_ci95": bootstrap_ci(won, n_boot, seed)}


# --- length-controlled win rate (stage 05) --------------------------------------------------------

def _fit_logistic(x: np.ndarray, wins: np.ndarray, l2: float = 0.1, iters: int = 100) -> tuple[float, float]:
    """Weighted logistic regression win ~ a + b*x by Newton's method, with an L2 penalty on both
    coefficients (keeps the fit finite when every premise is a win). Each premise counts once as a
    win with weight wins[i] and once as a loss with weight 1 - wins[i] (ties count half)."""
    X = np.stack([np.ones_like(x), x], axis=1)
    theta = np.zeros(2)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-X @ theta))
        grad = X.T @ (wins - p) - l2 * theta
        hess = (X * (p * (1 - p))[:, None]).T @ X + l2 * np.eye(2)
        step = np.linalg.solve(hess, grad)
        theta += step
        if np.abs(step).max() < 1e-8:
            break
    return float(theta[0]), float(theta[1])


def length_controlled_win_rate(scores: list[float], base_scores: list[float], lengths: list[float],
                               base_lengths: list[float], n_boot: int = 1000, seed: int = 0) -> dict:
    """The judge's preference for the model over the base with the length effect regressed out, in
    the spirit of AlpacaEval 2's length-controlled win rate: a logistic regression of the per-premise
    win (ties half) on the normalised length difference tanh((len - len_base) / sd), read at a length
    difference of zero: sigmoid(intercept). With a 95% percentile bootstrap interval over premises.
    `length_coef` is the fitted slope: how much a longer reply alone moves the judge."""
    won = wins(scores, base_scores)
    diff = np.log1p(np.asarray(lengths, float)) - np.log1p(np.asarray(base_lengths, float))
    sd = diff.std()
    x = np.tanh(diff / sd) if sd > 0 else np.zeros_like(diff)

    def lc(idx):
        a, slope = _fit_logistic(x[idx], won[idx])
        return 1 / (1 + np.exp(-a)), slope

    value, slope = lc(np.arange(len(won)))
    rng = np.random.default_rng(seed)
    boot = [lc(rng.integers(0, len(won), len(won)))[0] for _ in range(n_boot)]
    low, high = np.percentile(boot, [2.5, 97.5])
    return {"lc_win_rate_vs_base": float(value), "lc_win_rate_vs_base_ci95": [float(low), float(high)],
            "length_coef": float(slope)}


# --- ratings (review) ----------------------------------------------------------------------------

def rating_metrics(pred, gold, seed: int | None = None, n_boot: int = 1000) -> dict:
    """MAE, RMSE, Pearson r and Spearman rho of predicted vs gold ratings; r and rho are None when
    undefined (n < 2 or a constant side), everything but n is None when n == 0. With a `seed`: each with its 95% bootstrap
    interval (`<key>_ci`, percentiles over `n_boot` resamples of the pairs)."""
    p, g = np.asarray(pred, float), np.asarray(gold, float)
    if p.shape != g.shape or p.ndim != 1:
        raise ValueError(f"pred and gold must be equally long lists, got {p.shape} and {g.shape}")
    if not len(p):
        return {"rating_mae": None, "rating_rmse": None, "rating_pearson": None, "rating_spearman": None, "n": 0}
    out = {**_point(p, g), "n": len(p)}
    if seed is not None and len(p) >= 2:
        idx = np.random.default_rng(seed).integers(0, len(p), (n_boot, len(p)))
        draws = [_point(p[i], g[i]) for i in idx]
        for key in ("rating_mae", "rating_rmse", "rating_pearson", "rating_spearman"):
            values = [d[key] for d in draws if d[key] is not None]
            if out[key] is not None and len(values) >= n_boot // 2:
                out[f"{key}_ci"] = [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]
    return out


def _point(p: np.ndarray, g: np.ndarray) -> dict:
    defined = len(p) >= 2 and np.ptp(p) > 0 and np.ptp(g) > 0
    return {"rating_mae": float(np.abs(p - g).mean()), "rating_rmse": float(np.sqrt(((p - g) ** 2).mean())),
            "rating_pearson": float(np.corrcoef(p, g)[0, 1]) if defined else None,
            "rating_spearman": _spearman(p, g) if defined else None}


def _spearman(p: np.ndarray, g: np.ndarray) -> float:
    """Pearson r of the ranks (ties get their mean rank)."""
    return float(spearmanr(p, g).statistic)


def baseline_constant(train_mean: float, gold, seed: int | None = None) -> dict:
    """A predictor that always says the training split's mean rating."""
    return rating_metrics([float(train_mean)] * len(gold), gold, seed)


def baseline_human(human_ratings_per_paper, seed: int | None = None) -> dict:
    """One more human reviewer: each reviewer's rating against the mean of the same paper's other
    reviewers (leave-one-out), over all reviewers of papers with at least two; plus `n_papers`.
    Intervals resample the (reviewer, others) pairs."""
    pred, gold, papers = [], [], 0
    for ratings in human_ratings_per_paper:
        if len(ratings) < 2:
            continue
        papers += 1
        for i, r in enumerate(ratings):
            pred.append(float(r))
            gold.append((sum(ratings) - r) / (len(ratings) - 1))
    return {**rating_metrics(pred, gold, seed), "n_papers": papers}


def rating_source_metrics(pred, gold, constant: float, seed: int, n_boot: int = 1000) -> dict:
    """One rating source's metrics (05's rating sources, stage 03's rating model) on the papers where both it
    and the gold have a rating; the others are counted (`n_without_rating`). `mae_minus_constant`: mean over
    those papers of |pred - gold| - |constant - gold|, with a paired bootstrap interval (the same papers
    resampled for both)."""
    keep = [i for i, (p, g) in enumerate(zip(pred, gold)) if p is not None and g is not None]
    p, g = np.array([pred[i] for i in keep], float), np.array([gold[i] for i in keep], float)
    out = {**rating_metrics(p.tolist(), g.tolist(), seed, n_boot), "n_without_rating": len(pred) - len(keep)}
    diff = np.abs(p - g) - np.abs(constant - g)
    out["mae_minus_constant"] = float(diff.mean()) if len(diff) else None
    if len(diff) >= 2:
        draws = diff[np.random.default_rng(seed).integers(0, len(diff), (n_boot, len(diff)))].mean(1)
        out["mae_minus_constant_ci"] = [float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))]
    return out
