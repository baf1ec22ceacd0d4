"""The topic gate (stage 03's `topic_gate`): any judge, minus a penalty for a reply that has too little to
do with its post.

Winners share fewer words with their post than losers do (docs/results.md, "An unrelated reply"), so
every judge fitted on the pairs learns, more or less, that less in common is better, and a reply written
for another post has least: the gibberish audit's `other_post` kind. The tf-idf cosine of a reply with its
post ranks the real reply above another post's in 98% of later pairs, but as a judge it inverts the pairs
(the winner is nearer its post in about 40% of them). The gate uses that cosine only where it is low:

    gated(post, reply) = judge(post, reply) - weight * max(0, 1 - cosine / floor)

with `floor` the `topic_gate_quantile` of the train replies' own cosines (so that few real replies pay
anything) and `weight` = `topic_gate` x the sd of the judge's scores over the train replies (a weight in
the judge's own units, whatever its family). The fitted numbers and the tf-idf are saved in the run as
topic_gate.json; `run:PATH` (common/scorers.py) wraps the run's judge in them, so stages 04 and 05, the
ensembles and best of n all score with the gate.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from common.data import read_json, write_json
from common.features import Topic, premise_text
from common.runs import RunError

ARTIFACT = "topic_gate.json"


class TopicGated:
    """A Scorer: a judge's score minus the topic gate's penalty. Everything but the score is the judge's."""

    def __init__(self, judge, topic: Topic, floor: float, weight: float, fitted: dict | None = None):
        self.judge, self.topic, self.floor, self.weight = judge, topic, float(floor), float(weight)
        self.fitted = fitted or {"floor": self.floor, "weight": self.weight}  # what the run says of the gate

    def __getattr__(self, name):  # name, scoring, visible_reply, model...: the judge's own
        if name in ("judge", "fitted"):  # not set yet (copy, pickle): no recursion through self.judge
            raise AttributeError(name)
        return getattr(self.judge, name)

    @property
    def backends(self) -> dict:
        return {**self.judge.backends, "topic_gate": True}

    def audit_fields(self) -> dict:
        """judge_audit.json: the judge's own fields, the gate's numbers, and a sentence for the audit's text."""
        own = self.judge.audit_fields() if hasattr(self.judge, "audit_fields") else {}
        strength = f" {self.fitted['topic_gate']:g}" if "topic_gate" in self.fitted else ""
        below = (f" ({self.fitted['train_replies_gated']} of {self.fitted['train_replies']} train replies are below)"
                 if "train_replies" in self.fitted else "")
        note = (f"Topic gate{strength}: a reply loses up to {self.weight:.3g} of its score, all of it with no content "
                f"word of its post, none at a tf-idf cosine of {self.floor:.3g} or more{below}.")
        return {**own, "topic_gate": self.fitted, "audit_note": note}

    def penalty(self, prompts: list[list[dict]], replies: list[str]) -> np.ndarray:
        cosines = self.topic.cosines([premise_text(p) for p in prompts], replies)
        if self.floor <= 0:  # half the train replies or more share no content word with their post: no gate
            return np.zeros(len(replies))
        return self.weight * np.clip(1.0 - cosines / self.floor, 0.0, 1.0)

    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        if not replies:
            return []
        return [float(s) for s in np.asarray(self.judge.score(prompts, replies), float) - self.penalty(prompts, replies)]

    @classmethod
    def fit(cls, judge, rows: list[dict], strength: float, quantile: float) -> "TopicGated":
        """From the train pairs' real replies (winners and losers; corruption and hard-negative pairs are not
        in `rows`): the tf-idf, the floor at `quantile` of their cosines, the judge's sd over them."""
        prompts = [r["prompt"] for r in rows for _ in (0, 1)]
        replies = [r[key] for r in rows for key in ("chosen", "rejected")]
        topic = Topic.fit([premise_text(p) for p in prompts], replies)
        cosines = topic.cosines([premise_text(p) for p in prompts], replies)
        floor = float(np.quantile(cosines, quantile)) if len(cosines) else 0.0
        sd = (float(np.std(judge.score(prompts, replies))) if replies else 0.0) or 1.0  # all equal: nothing to scale
        return cls(judge, topic, floor, strength * sd, {
            "topic_gate": strength, "topic_gate_quantile": quantile, "floor": floor, "judge_sd": sd,
            "weight": strength * sd, "train_replies": len(replies), "train_replies_gated": int((cosines < floor).sum())})

    def save(self, run_dir: Path) -> None:
        write_json(Path(run_dir) / ARTIFACT, {**self.fitted, "topic": self.topic.to_json()})

    @classmethod
    def wrap(cls, judge, run_dir: str | Path, config=None):
        """`judge` gated as its run says (topic_gate.json), or `judge` itself in a run without a gate. A run whose
        `config` asks for a gate and lacks the file is an error, never a judge scored without it."""
        path = Path(run_dir) / ARTIFACT
        if not path.is_file():
            if getattr(config, "topic_gate", 0):
                raise RunError(f"judge {Path(run_dir).name}: its config has topic_gate but {ARTIFACT} is missing "
                               f"(not a finished run of stage 03, or a damaged one)")
            return judge
        saved = read_json(path)
        topic = Topic.from_json(saved.pop("topic"))
        return cls(judge, topic, saved["floor"], saved["weight"], saved)
