"""The judge audit of stage 03: is the reward model better than cheap shortcuts, and can it be fooled
cheaply? Written to `judge_audit.json` beside the adapter.

- Baselines trained on the judge's own train pairs and scored on the same held-out pairs: a
  length-only model and a bag-of-words logistic regression (scikit-learn). Both are pairwise
  (Bradley-Terry-like) linear scorers: a logistic regression without intercept on the feature
  difference winner - loser (each pair also enters mirrored), so, like the judge, they give each
  reply a score and pick the higher one.
- The Spearman correlation of the judge's score with reply length (words).
- Shortcut probes (the task's `PROBES`: CMV's in common/tasks/cmv.py): a cheap edit of one reply
  of every held-out pair, re-scored. Each reports the
  mean score change of the edited reply (with a bootstrap interval, and in units of the standard
  deviation of the judge's scores), the share of pairs whose verdict flips, and the share that flip
  to the loser. The judge "falls for" a probe when the change goes the way a cheat wants (up for
  an edited loser, down for a cut winner), its interval excludes zero, and it is not small: at
  least FALLS_FOR_SD standard deviations, or FALLS_FOR_FLIPS of the pairs flipping to the loser.
- The gibberish audit (common/corruptions.py, key `corruption`): how often the judge prefers each real
  held-out reply to six corruptions of it (shuffled, word salad, a sentence repeated, the premise
  copied, another post's reply, cut mid-sentence).
- A plain-language verdict naming the probes the judge falls for.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Callable

import numpy as np

from common import corruptions
from common.data import n_words, write_json
from common.features import word_tfidf
from common.metrics import bootstrap_ci, preference_metrics, wins

log = logging.getLogger("pipeline")

FALLS_FOR_SD = 0.2      # a "small" standardised effect (Cohen)
FALLS_FOR_FLIPS = 0.10  # a tenth of the verdicts moved to the loser by a cheap edit
N_BOOT = 1000

# --- baselines --------------------------------------------------------------------------------------

class LengthFeatures:
    """A reply's length and nothing else: log(1 + words) and a one-hot of its decile among the train
    replies, so the fitted score can be any step function of length (the best a pointwise judge can
    do with length alone), not just "longer is better". Words are what stage 01 balances; words and
    characters together would also carry the mean word length, a style cue (links, long words)."""
    names = ["log1p_words"] + [f"words_decile_{i}" for i in range(10)]

    def __init__(self, train_texts: list[str]):
        self.edges = np.quantile([math.log1p(n_words(t)) for t in train_texts], np.linspace(0.1, 0.9, 9))

    def __call__(self, texts: list[str]) -> np.ndarray:
        logs = np.array([math.log1p(n_words(t)) for t in texts])
        onehot = np.eye(10)[np.searchsorted(self.edges, logs, side="right")]
        return np.c_[logs, onehot]


def _fit_pairwise(x_chosen, x_rejected, C: float = 1.0):
    """Logistic regression without intercept on winner - loser (label 1) and loser - winner (0)."""
    import scipy.sparse as sp
    from sklearn.linear_model import LogisticRegression
    diff = x_chosen - x_rejected
    stacked = sp.vstack([diff, -diff]).tocsr() if sp.issparse(diff) else np.vstack([diff, -diff])
    model = LogisticRegression(fit_intercept=False, C=C, max_iter=2000)
    model.fit(stacked, np.r_[np.ones(diff.shape[0]), np.zeros(diff.shape[0])])
    return model


def _pairwise_accuracy(model, x_chosen, x_rejected) -> float:
    return float(wins(np.ravel(model.decision_function(x_chosen)), np.ravel(model.decision_function(x_rejected))).mean())


def baselines(train: list[dict], evals: dict[str, list[dict]], top_k: int = 12) -> dict:
    """Length-only and bag-of-words pairwise logistic regressions, fitted on `train`, with their
    accuracy on `train` and on every split of `evals`. The bag-of-words model also lists the words
    that most favour the winner and the loser (a leftover give-away shows up there)."""
    out = {}
    length_features = LengthFeatures([p["chosen"] for p in train] + [p["rejected"] for p in train])
    feats = lambda rows, key: length_features([p[key] for p in rows])  # noqa: E731
    length_model = _fit_pairwise(feats(train, "chosen"), feats(train, "rejected"))
    out["length_only"] = {
        "model": "logistic regression on winner - loser of log words + word-count deciles (a step function of length)",
        "features": LengthFeatures.names,
        "coef": [float(c) for c in length_model.coef_[0]],
        "train_accuracy": _pairwise_accuracy(length_model, feats(train, "chosen"), feats(train, "rejected")),
        **{f"{name}_accuracy": _pairwise_accuracy(length_model, feats(rows, "chosen"), feats(rows, "rejected"))
           for name, rows in evals.items() if rows}}
    vectorizer = word_tfidf()
    vectorizer.fit([p["chosen"] for p in train] + [p["rejected"] for p in train])
    vec = lambda rows, key: vectorizer.transform([p[key] for p in rows])  # noqa: E731
    bow = _fit_pairwise(vec(train, "chosen"), vec(train, "rejected"))
    words = vectorizer.get_feature_names_out()
    order = np.argsort(bow.coef_[0])
    out["bag_of_words"] = {
        "model": "tf-idf unigrams (min_df 2) + logistic regression on winner - loser, C=1",
        "vocabulary": len(words),
        "train_accuracy": _pairwise_accuracy(bow, vec(train, "chosen"), vec(train, "rejected")),
        **{f"{name}_accuracy": _pairwise_accuracy(bow, vec(rows, "chosen"), vec(rows, "rejected"))
           for name, rows in evals.items() if rows},
        "top_winner_words": [str(words[i]) for i in order[::-1][:top_k]],
        "top_loser_words": [str(words[i]) for i in order[:top_k]],
    }
    return out


# --- the audit --------------------------------------------------------------------------------------

def run_probes(score: Callable, pairs: list[dict], chosen: list[float], rejected: list[float],
               seed: int = 0, probes=()) -> dict:
    """Every probe on every pair: the edited reply re-scored, the verdict re-read. A probe is (name,
    which reply is edited, what a cheat wants the score to do, edit, description)."""
    c, r = np.asarray(chosen, float), np.asarray(rejected, float)
    sd = float(np.std(np.r_[c, r])) or 1.0
    prompts = [p["prompt"] for p in pairs]
    out = {}
    for name, target, cheat_sign, edit, description in probes:
        edited = [edit(p[target], p) for p in pairs]
        new = np.asarray(score(prompts, edited), float)
        old = c if target == "chosen" else r
        c2, r2 = (new, r) if target == "chosen" else (c, new)
        change = new - old
        before, after = np.sign(c - r), np.sign(c2 - r2)
        to_loser = (before > 0) & (after < 0)
        ci = bootstrap_ci(change, N_BOOT, seed)
        mean = float(change.mean())
        effect = cheat_sign * mean / sd
        significant = (ci[0] > 0) if cheat_sign > 0 else (ci[1] < 0)
        flips_to_loser = float(to_loser.mean())
        out[name] = {
            "description": description, "edited": "loser" if target == "rejected" else "winner",
            "mean_words_added": float(np.mean([n_words(e) - n_words(p[target]) for e, p in zip(edited, pairs)])),
            "mean_score_change": mean, "mean_score_change_ci95": ci, "mean_score_change_sd": mean / sd,
            "flip_rate": float(np.mean(before != after)), "flip_to_loser_rate": flips_to_loser,
            "accuracy_after": float(wins(c2, r2).mean()),
            "falls_for": bool(significant and (effect >= FALLS_FOR_SD or flips_to_loser >= FALLS_FOR_FLIPS)),
        }
    return out


def verdict(audit: dict) -> dict:
    """The audit in plain words: what the judge falls for, how it compares with the baselines."""
    judge, base = audit["judge"], audit["baselines"]
    split = audit["split"]
    falls = [n for n, p in audit["probes"].items() if p["falls_for"]]
    lines = []
    low = judge["accuracy_ci95"][0]
    length_acc = base["length_only"].get(f"{split}_accuracy")
    bow_acc = base["bag_of_words"].get(f"{split}_accuracy")
    lines.append(f"On {judge['n_pairs']} {_where(split, audit.get('periods', {}))} the judge picks the winner {judge['accuracy']:.1%} of the time "
                 f"(95% CI {judge['accuracy_ci95'][0]:.1%}-{judge['accuracy_ci95'][1]:.1%}); a length-only model "
                 f"gets {length_acc:.1%} and a bag-of-words model {bow_acc:.1%}.")
    best = max(length_acc, bow_acc, 0.5)
    lines.append("It is better than both shortcuts beyond chance." if low > best else
                 "It is NOT shown to be better than the shortcuts (its interval reaches down to them or to chance).")
    for name, other in audit["other_splits"].items():  # every other held-out split, the later period named
        lines.append(f"On {other['n_pairs']} {_where(name, audit.get('periods', {}))}: accuracy {other['accuracy']:.1%} "
                     f"(95% CI {other['accuracy_ci95'][0]:.1%}-{other['accuracy_ci95'][1]:.1%}) vs length-only "
                     f"{base['length_only'].get(f'{name}_accuracy'):.1%} and bag-of-words "
                     f"{base['bag_of_words'].get(f'{name}_accuracy'):.1%}.")
    rho = judge["score_length_spearman"]
    if rho is not None:
        strength = "strongly" if abs(rho) >= 0.5 else "moderately" if abs(rho) >= 0.3 else "weakly" if abs(rho) >= 0.1 else "barely"
        lines.append(f"Its scores are {strength} tied to reply length (Spearman {rho:+.2f}).")
    for name in falls:
        p = audit["probes"][name]
        lines.append(f"FALLS FOR {name}: {p['description']} moves the edited reply's score by "
                     f"{p['mean_score_change']:+.3f} ({p['mean_score_change_sd']:+.2f} sd) and hands "
                     f"{p['flip_to_loser_rate']:.0%} of the pairs to the loser.")
    resisted = [n for n in audit["probes"] if n not in falls]
    if resisted:
        lines.append("Resists: " + ", ".join(resisted) + ".")
    return {"falls_for": falls, "resists": resisted, "text": " ".join(lines)}


def _where(split: str, periods: dict) -> str:
    """A split as the verdict names it: the source's later period when the pairs were split by period."""
    if periods.get(split) == "period":
        return f"pairs from later posts ({split}, split_by period)"
    return f"{split} pairs" + (" (in-period)" if split in periods else "")


def audit(score: Callable, train: list[dict], eval_pairs: list[dict], chosen: list[float],
          rejected: list[float], split: str = "dev", extra: dict | None = None, seed: int = 0,
          periods: dict | None = None, probes=()) -> dict:
    """The whole audit on `eval_pairs` (scores of the judge given in chosen/rejected); `extra` maps
    other held-out splits to (pairs, chosen scores, rejected scores) for accuracy next to baselines.
    `periods` maps splits to "period" (the source's later posts) or "in-period" when the pairs run
    was split by period."""
    extra = extra or {}
    result = {
        "split": split,
        "periods": periods or {},
        "judge": preference_metrics(eval_pairs, chosen, rejected, seed),
        "baselines": baselines(train, {split: eval_pairs, **{k: v[0] for k, v in extra.items()}}),
        "probes": run_probes(score, eval_pairs, chosen, rejected, seed, probes),
        "other_splits": {k: preference_metrics(*v, seed=seed) for k, v in extra.items()},
        "thresholds": {"falls_for_sd": FALLS_FOR_SD, "falls_for_flips": FALLS_FOR_FLIPS, "n_boot": N_BOOT},
    }
    result["verdict"] = verdict(result)
    return result


def write_judge_audit(run_dir: Path, scorer, train: list[dict], dev: list[dict], chosen: list[float],
                      rejected: list[float], extra_splits: dict[str, list[dict]], seed: int = 0,
                      split: str = "dev", periods: dict | None = None, probes=(),
                      corruption_splits: dict[str, list[dict]] | None = None) -> dict:
    """Stage 03's step: score the extra held-out splits, audit on `dev` (the pairs of `split`), write
    judge_audit.json beside the adapter, log the verdict; returns the summary that goes into
    metrics.json. It reads only scores, so a pairwise and a pointwise judge are audited alike.
    `corruption_splits`: the held-out pairs of the gibberish audit (key `corruption`, common/corruptions.py)."""
    if not dev or not train:
        write_json(Path(run_dir) / "judge_audit.json", {"skipped": f"no train or {split} pairs to audit on"})
        log.warning("judge audit skipped: no train or %s pairs", split)
        return {"skipped": True}
    extra = {}
    for name, rows in extra_splits.items():
        if rows:
            prompts = [r["prompt"] for r in rows]
            extra[name] = (rows, scorer.score(prompts, [r["chosen"] for r in rows]),
                           scorer.score(prompts, [r["rejected"] for r in rows]))
    result = audit(scorer.score, train, dev, chosen, rejected, split, extra, seed, periods, probes)
    if corruption_splits:
        result["corruption"] = corruptions.corruption_audit(scorer, corruption_splits, seed=seed)
        result["verdict"]["text"] += " " + corruptions.verdict_line(result["corruption"])
    result.update(scorer.audit_fields() if hasattr(scorer, "audit_fields") else {})  # e.g. feature_coefficients
    if result.get("audit_note"):  # what the judge says of itself in the audit's text (e.g. a topic gate)
        result["verdict"]["text"] += " " + result.pop("audit_note")
    write_json(Path(run_dir) / "judge_audit.json", result)
    log.info("judge audit: %s", result["verdict"]["text"])
    summary = {"split": split, "accuracy": result["judge"]["accuracy"], "accuracy_ci95": result["judge"]["accuracy_ci95"],
               "length_only_baseline_accuracy": result["baselines"]["length_only"].get(f"{split}_accuracy"),
               "bag_of_words_baseline_accuracy": result["baselines"]["bag_of_words"].get(f"{split}_accuracy"),
               "falls_for": result["verdict"]["falls_for"], "periods": result["periods"]}
    if "corruption" in result:
        summary["corruption"] = corruptions.summary(result["corruption"])
    for name, metrics in result["other_splits"].items():
        summary[f"{name}_accuracy"], summary[f"{name}_accuracy_ci95"] = metrics["accuracy"], metrics["accuracy_ci95"]
        summary[f"{name}_length_only_baseline_accuracy"] = result["baselines"]["length_only"].get(f"{name}_accuracy")
        summary[f"{name}_bag_of_words_baseline_accuracy"] = result["baselines"]["bag_of_words"].get(f"{name}_accuracy")
    return summary
