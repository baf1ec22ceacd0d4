"""Conservative ensembles of judges (stage 03's `judge_backbone: ensemble`; Coste et al. 2024, "Reward
Model Ensembles Help Mitigate Overoptimization"): several finished judge runs of ONE pairs run scored
as one judge. A policy that games one member's blind spot gains nothing when the ensemble takes the
worst member's opinion (`min`) or discounts disagreement (`mean_minus_std`: mean - lambda * sd).

Members' scores are on different scales (a pairwise margin, a pointwise logit, a linear feature
score), so each is z-scored with its mean and sd over the pairs run's train replies (winners and
losers), measured at stage 03 and saved in the run as ensemble.json with each member's path, run
name and artifact digest. Members may sit on different backbones (an encoder, a 4-bit decoder, the
feature judge); one trained on another pairs run is refused, and so, at load, is a member whose
files changed since the ensemble was built.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data import read_json, write_json
from common.judges import TRAIN_POSTS, train_posts
from common.provenance import digest_of
from common.runs import RunError, _unchanged_artifacts, check_input, lineage, require_done

ARTIFACT = "ensemble.json"


def z_stats(scores) -> dict:
    """Mean and sd of one member's scores (sd 1 when they are all equal: nothing to rescale)."""
    scores = np.asarray(scores, float)
    return {"mean": float(scores.mean()), "sd": float(scores.std()) or 1.0}


def combine(z, how: str, lam: float = 1.0) -> np.ndarray:
    """[members, replies] z-scores -> one score per reply: the lowest (min), or mean - lam * sd."""
    z = np.asarray(z, float)
    if how == "min":
        return z.min(0)
    if how == "mean_minus_std":
        return z.mean(0) - lam * z.std(0)
    raise ValueError(f"ensemble_combine: unknown {how!r} (min or mean_minus_std)")


def check_members(config) -> list[dict]:
    """Stage 03, before its run directory exists: every member finished, unchanged, of config.pairs_run,
    with its training posts recorded (05 checks them). Returns what ensemble.json records of each."""
    # The pairs run by path and content (common/runs.py lineage): one rebuilt at the same path is another.
    ours_path, ours_digest = lineage(check_input("pairs_run", config.pairs_run), Path(config.pairs_run))
    records = []
    for i, path in enumerate(config.ensemble_of):
        manifest = check_input(f"ensemble_of[{i}]", path)
        theirs_path, theirs_digest = lineage(manifest, Path(path))
        if theirs_path != ours_path or (theirs_digest and ours_digest and theirs_digest != ours_digest):
            raise RunError(f"ensemble_of: judge {Path(path).name} ({path}) was trained on pairs run {theirs_path}, "
                           f"not this ensemble's {ours_path}: an ensemble's judges must share one pairs run")
        train_posts(path)
        records.append({"path": str(Path(path).resolve()), "run_name": manifest.get("run_name"),
                        "judge": manifest.get("judge"), "artifacts_sha256": digest_of(manifest["_digests"])})
    return records


class EnsembleScorer:
    """A Scorer over loaded member scorers: each member's z-scored score, combined."""

    def __init__(self, members: list, stats: list[dict], how: str, lam: float, name: str = "ensemble"):
        self.members, self.stats, self.how, self.lam, self.name = members, stats, how, lam, name

    @property
    def scoring(self) -> str:
        return "ensemble(" + ", ".join(getattr(m, "scoring", m.name) for m in self.members) + ")"

    @property
    def backends(self) -> dict:
        return {"judge_scoring": self.scoring}

    def member_z(self, prompts, replies) -> np.ndarray:
        return np.array([(np.asarray(m.score(prompts, replies), float) - s["mean"]) / s["sd"]
                         for m, s in zip(self.members, self.stats)]).reshape(len(self.members), len(replies))

    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        if not replies:
            return []
        return [float(s) for s in combine(self.member_z(prompts, replies), self.how, self.lam)]

    def audit_fields(self) -> dict:
        saved = getattr(self, "saved", None)
        return {"ensemble": saved} if saved else {}

    @classmethod
    def build(cls, config, run_dir: Path, records: list[dict], train_rows: list[dict], batch_size: int = 8,
              packed: bool = True) -> "EnsembleScorer":
        """Stage 03: load the members (`records`: check_members'), measure each one's z-stats on the train
        replies, write ensemble.json and train_posts.json (the members' posts, all of them)."""
        from common.scorers import load_scorer
        members = []
        prompts = [r["prompt"] for r in train_rows] * 2
        replies = [r["chosen"] for r in train_rows] + [r["rejected"] for r in train_rows]
        for record in records:
            member = load_scorer(f"run:{record['path']}", batch_size=batch_size, packed=packed)
            record["z"] = z_stats(member.score(prompts, replies))
            members.append(member)
        saved = {"combine": config.ensemble_combine, "lambda": config.ensemble_lambda,
                 "z_from": f"{config.train_split} replies of the pairs run (winners and losers), {len(replies)}",
                 "members": records}
        write_json(Path(run_dir) / ARTIFACT, saved)
        posts, premises = set(), set()
        for record in records:
            p, d = train_posts(record["path"])
            posts, premises = posts | p, premises | d
        write_json(Path(run_dir) / TRAIN_POSTS, {"split": "ensemble", "ensemble_of": [r["run_name"] for r in records],
                                                 "train_also": [], "n_pairs": None, "posts": sorted(posts),
                                                 "premises": sorted(premises)})
        scorer = cls(members, [r["z"] for r in records], config.ensemble_combine, config.ensemble_lambda,
                     name=Path(run_dir).name)
        scorer.saved = saved
        return scorer

    @classmethod
    def from_run(cls, reward_run: str | Path, batch_size: int = 8, packed: bool = True) -> "EnsembleScorer":
        """A finished ensemble run's judge, its members loaded; a member changed since is refused."""
        from common.scorers import load_scorer
        reward_run = Path(reward_run)
        saved = read_json(reward_run / ARTIFACT)
        members = []
        for record in saved["members"]:
            path = Path(record["path"])
            manifest = require_done(path)
            now = digest_of(_unchanged_artifacts(path, manifest))
            if now != record["artifacts_sha256"]:
                raise RunError(f"ensemble {reward_run.name}: its judge {record['run_name']} ({path}) changed since "
                               f"the ensemble was built (artifacts sha256 {now[:12]}, recorded "
                               f"{record['artifacts_sha256'][:12]}): re-run the ensemble's stage 03")
            members.append(load_scorer(f"run:{path}", batch_size=batch_size, packed=packed))
        scorer = cls(members, [r["z"] for r in saved["members"]], saved["combine"], saved["lambda"],
                     name=reward_run.name)
        scorer.saved = saved
        return scorer
