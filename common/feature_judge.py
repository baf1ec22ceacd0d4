"""The feature judge (stage 03's `judge_backbone: features`): a pairwise logistic regression on the
features of common/features.py (Tan et al. 2016), no neural model, fitted on the CPU in seconds.
Its topic features' tf-idf is fitted first, on the posts and replies of the pairs that are not
corruption or hard-negative pairs.

Each feature is standardised with its mean and scale over the train replies (winners and losers);
the regression sees winner - loser (label 1) and loser - winner (0) without an intercept, as the
audit's baselines do (common/audit.py), so a reply's score is w . standardised features(post, reply).
Saved in the run as feature_judge.json (names, means, scales, coefficients, the topic model), in the
place of an adapter; `FeatureScorer.from_run` rebuilds it and refuses one saved under other features.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from common.data import read_json, write_json
from common.features import FEATURE_NAMES, FEATURES_VERSION, Topic, features, premise_text
from common.runs import RunError

ARTIFACT = "feature_judge.json"


def feature_fingerprint() -> dict:
    """What identifies a feature judge's backbone, in place of a model's weights: the features' version
    and names (the fitted numbers are the run's artifact, covered by its digests)."""
    return {"backbone": "features", "features_version": FEATURES_VERSION,
            "feature_names_sha256": hashlib.sha256(json.dumps(FEATURE_NAMES).encode()).hexdigest()}


def feature_matrix(prompts: list[list[dict]], replies: list[str], topic: Topic) -> np.ndarray:
    premises = [premise_text(p) for p in prompts]
    text = np.array([features(p, r) for p, r in zip(premises, replies)], dtype=float).reshape(len(replies), -1)
    return np.hstack([text, topic.features(premises, replies)]).reshape(len(replies), len(FEATURE_NAMES))


class FeatureScorer:
    """A Scorer: w . (features(post, reply) - mean) / scale."""

    scoring = "features"

    def __init__(self, mean, scale, coef, topic: Topic, name: str = "features"):
        self.mean, self.scale, self.coef = (np.asarray(v, float) for v in (mean, scale, coef))
        self.topic, self.name = topic, name

    @property
    def backends(self) -> dict:
        return {"judge_scoring": self.scoring}

    @classmethod
    def fit(cls, rows: list[dict], C: float = 1.0) -> "FeatureScorer":
        """Fitted on winner-vs-loser pairs ({"prompt", "chosen", "rejected"})."""
        from common.audit import _fit_pairwise
        real = [(premise_text(r["prompt"]), r[key]) for r in rows if not r.get("negative") for key in ("chosen", "rejected")]
        topic = Topic.fit([p for p, _ in real], [reply for _, reply in real])
        prompts = [r["prompt"] for r in rows]
        chosen = feature_matrix(prompts, [r["chosen"] for r in rows], topic)
        rejected = feature_matrix(prompts, [r["rejected"] for r in rows], topic)
        both = np.vstack([chosen, rejected])
        mean, scale = both.mean(0), both.std(0)
        scale[scale == 0] = 1.0  # a feature constant over the train replies carries nothing
        model = _fit_pairwise((chosen - mean) / scale, (rejected - mean) / scale, C=C)
        return cls(mean, scale, model.coef_[0], topic)

    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        if not replies:
            return []
        return [float(s) for s in ((feature_matrix(prompts, replies, self.topic) - self.mean) / self.scale) @ self.coef]

    def coefficients(self) -> dict[str, float]:
        return {n: float(c) for n, c in zip(FEATURE_NAMES, self.coef)}

    def audit_fields(self) -> dict:
        """What judge_audit.json says of it besides scores: its coefficients by feature, largest first."""
        ranked = sorted(self.coefficients().items(), key=lambda kv: -abs(kv[1]))
        return {"feature_coefficients": dict(ranked)}

    def save(self, run_dir: Path) -> None:
        write_json(Path(run_dir) / ARTIFACT, {**feature_fingerprint(), "feature_names": FEATURE_NAMES,
                                              "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                                              "coef": self.coef.tolist(), "topic": self.topic.to_json()})

    @classmethod
    def from_run(cls, reward_run: str | Path, **_) -> "FeatureScorer":
        reward_run = Path(reward_run)
        path = reward_run / ARTIFACT
        if not path.is_file():
            raise RunError(f"feature judge {reward_run.name}: no {ARTIFACT} (not a finished features judge)")
        saved = read_json(path)
        if saved.get("feature_names") != FEATURE_NAMES or saved.get("features_version") != FEATURES_VERSION:
            raise RunError(f"feature judge {reward_run.name} was fitted on other features (version "
                           f"{saved.get('features_version')}, this code computes version {FEATURES_VERSION}): re-run stage 03")
        return cls(saved["mean"], saved["scale"], saved["coef"], Topic.from_json(saved["topic"]), name=reward_run.name)
