"""Metrics: judge quality on preference pairs, text overlap, win rates with bootstrap intervals."""
from __future__ import annotations

import numpy as np
from rouge_score import rouge_scorer
from sacrebleu.metrics import BLEU
from scipy.stats import spearmanr

from common.data import length_only_accuracy, n_words


def preference_metrics(pairs: list[dict], chosen_scores: list[float], rejected_scores: list[float]) -> dict:
    """How well a judge separates winners from losers, and how much it just counts words."""
    chosen, rejected = np.asarray(chosen_scores), np.asarray(rejected_scores)
    lengths = [n_words(p["chosen"]) for p in pairs] + [n_words(p["rejected"]) for p in pairs]
    rho = spearmanr(np.concatenate([chosen, rejected]), lengths).statistic if len(pairs) > 1 else None
    return {
        "n_pairs": len(pairs),
        "accuracy": float(np.mean(chosen > rejected)),
        "mean_margin": float(np.mean(chosen - rejected)),
        "length_only_accuracy": length_only_accuracy(pairs),
        "score_length_spearman": None if rho is None or np.isnan(rho) else float(rho),
    }


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU-4 (sacrebleu's default tokenizer), 0-100."""
    return float(BLEU().corpus_score(hypotheses, [references]).score)


def rouge(hypotheses: list[str], references: list[str], kinds=("rougeL",)) -> dict:
    """Mean ROUGE F1 per kind, 0-1."""
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    scores = [scorer.score(ref, hyp) for hyp, ref in zip(hypotheses, references)]
    return {k: float(np.mean([s[k].fmeasure for s in scores])) if scores else 0.0 for k in kinds}


def win_rate(scores: list[float], base_scores: list[float], n_boot: int = 2000, seed: int = 0) -> dict:
    """Share of premises where the model's reply out-scores the base's (ties count half), with a
    95% percentile bootstrap interval over premises."""
    wins = (np.asarray(scores) > np.asarray(base_scores)) + 0.5 * (np.asarray(scores) == np.asarray(base_scores))
    rng = np.random.default_rng(seed)
    boot = wins[rng.integers(0, len(wins), size=(n_boot, len(wins)))].mean(axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return {"win_rate_vs_base": float(wins.mean()), "win_rate_vs_base_ci95": [float(low), float(high)]}
