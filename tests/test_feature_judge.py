"""The feature judge (common/features.py, common/feature_judge.py) and conservative ensembles of judge
runs (common/ensemble.py): features on fixed text, z-scoring and the two combinations on fixed scores,
stage 03 fitting both and `load_scorer("run:PATH")` rebuilding them, the refusals, and stage 05 scoring
with an ensemble."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import error_line, run_dir_of, run_stage

from common.data import load_split
from common.ensemble import EnsembleScorer, combine, z_stats
from common.feature_judge import FeatureScorer
from common.features import FEATURE_NAMES, TEXT_FEATURES, Topic, features
from common.runs import RunError
from common.scorers import load_scorer

POST = "Cats are better pets than dogs. I think dogs need too much time, and cats are quiet."
REPLY = ("> dogs need too much time\n\nPerhaps, but you might find that a dog gets you outside. For example, "
         "the 2019 study (https://example.org/a) found 34 % more walking.\n\nWhat about \"quiet\" cats at 4 am?")


def test_features_on_fixed_text():
    f = dict(zip(TEXT_FEATURES, features(POST, REPLY)))
    assert len(f) == len(TEXT_FEATURES) == 26
    op = {"cats", "are", "better", "pets", "than", "dogs", "i", "think", "need", "too", "much", "time", "and", "quiet"}
    # Reply word types shared with the post: dogs, need, time, quiet, cats (content) and too, much (stop words).
    assert f["shared_words"] == pytest.approx(math.log1p(7))
    assert f["shared_content_words"] == pytest.approx(math.log1p(5))
    assert f["shared_stop_words"] == pytest.approx(math.log1p(2))
    assert f["op_words_in_reply"] == pytest.approx(7 / len(op))
    assert 0 < f["jaccard_words"] < f["op_words_in_reply"]
    assert f["log_words"] == pytest.approx(math.log1p(len(REPLY.split())))
    counts = {"paragraphs": 3, "hedges": 2, "definite_articles": 1, "indefinite_articles": 2, "second_person": 2,
              "questions": 1, "quoted_lines": 1, "quotation_marks": 2, "links": 1, "examples": 1, "numbers": 3}
    for name, n in counts.items():
        assert f[name] == pytest.approx(math.log1p(n)), name
    # The same reply to a post it shares nothing with: no interplay, the same style.
    other = dict(zip(TEXT_FEATURES, features("Zebras graze.", REPLY)))
    assert other["shared_words"] == other["jaccard_words"] == 0 and other["hedges"] == f["hedges"]


def test_form_features_see_each_kind_of_gibberish():
    """Each form feature on a reply and on its corruptions (common/corruptions.py): shuffled and salad words
    lose the common word pairs, repetition loses distinct pairs and repeats sentences, a cut reply ends no
    sentence, a copy of the post is all post 5-grams."""
    from common.corruptions import corrupt
    post = "I think that the minimum wage should be raised because it is the fair thing to do for workers."
    reply = ("It is not clear that a higher minimum wage helps the workers it is meant for. In the short run some of "
             "them lose hours. There is a lot of evidence on both sides, and I think you have to weigh it. What do "
             "the studies of the same policy in other cities say?")
    f = lambda text: dict(zip(TEXT_FEATURES, features(post, text)))  # noqa: E731
    real = f(reply)
    assert real["ends_a_sentence"] == 1 and real["repeated_sentences"] == 0 and real["premise_5grams"] == 0
    assert real["common_bigrams"] > 0.1 and real["distinct_2"] > 0.95
    bad = {kind: f(corrupt(kind, reply, post, ["Another reply."], seed=0)) for kind in ("shuffle", "salad", "repeat",
                                                                                       "premise_copy", "cut")}
    assert bad["shuffle"]["common_bigrams"] < real["common_bigrams"] / 2
    assert bad["salad"]["common_bigrams"] < real["common_bigrams"] / 2
    assert bad["repeat"]["distinct_2"] < 0.5 and bad["repeat"]["repeated_sentences"] >= 0.5
    assert bad["premise_copy"]["premise_5grams"] == 1
    assert bad["cut"]["ends_a_sentence"] == 0


def test_topic_features_on_fixed_text():
    """tf-idf cosine of content words (idf over the fitting texts, words in two of them), cut at the floor;
    a reply to another post has nothing in common with this one's; the saved model gives the same numbers."""
    posts = ["Cats are better pets than dogs.", "Taxes on sugar help public health.", "Cats are better pets than dogs."]
    replies = ["Dogs are loyal pets, cats are not.", "Sugar taxes hit the poor, and health gains are small.",
               "Cats sleep all day; dogs want walks."]
    topic = Topic.fit(posts, replies)
    # Five distinct texts (the post given twice counts once); words in one of them ("better", "loyal") are out.
    vocabulary = topic.vectorizer.vocabulary_
    assert set(vocabulary) == {"cats", "dogs", "pets", "sugar", "taxes", "health"}
    assert topic.vectorizer.idf_[vocabulary["cats"]] == pytest.approx(math.log(6 / 4) + 1)  # in 3 of the 5 texts
    assert topic.cosine(posts[0], posts[0]) == pytest.approx(1.0)
    assert topic.cosine(posts[0], replies[1]) == 0.0 and topic.cosine(posts[0], "") == 0.0
    cosines = sorted(topic.cosine(p, r) for p, r in zip(posts, replies))
    assert topic.floor == cosines[0]  # the 10% quantile of three: the lowest
    (cos, cut), = topic.features(posts[:1], replies[:1]).tolist()
    assert cos == pytest.approx(topic.cosine(posts[0], replies[0])) and cut == min(cos, topic.floor)
    again = Topic.from_json(json.loads(json.dumps(topic.to_json())))
    assert again.features(posts, replies).tolist() == topic.features(posts, replies).tolist()
    assert Topic.fit(["a b"], ["c d"]).features(["a b"], ["c d"]).tolist() == [[0.0, 0.0]]  # no word in two texts


def test_other_post_pairs_teach_the_topic_features():
    """Replies on the post's topic win and lose alike, so the pairs alone leave the topic features near 0;
    with (real reply over a reply to another post) pairs the judge ranks each real reply above the other post's."""
    from common.corruptions import corruption_pairs
    rng = np.random.default_rng(0)
    filler = "the a it is that because however people think evidence reason claim view".split()
    topics = [rng.choice(list("bcdfghjklmnprstvwz"), size=(6, 7)) for _ in range(40)]
    rows = []
    for i, t in enumerate(topics):
        names = ["".join(w) for w in t]
        text = lambda k: " ".join(rng.choice(filler, 20)) + " " + " ".join(rng.choice(names, k))  # noqa: E731
        rows.append({"id": str(i), "group_id": str(i), "prompt": [{"role": "user", "content": " ".join(names * 2)}],
                     "chosen": "> " + text(3) + ".", "rejected": text(3) + "."})
    bad, _ = corruption_pairs(rows, ["other_post"], seed=0, share=1.0)
    plain, taught = FeatureScorer.fit(rows), FeatureScorer.fit(rows + bad)
    assert taught.coefficients()["topic_cosine_to_floor"] > abs(plain.coefficients()["topic_cosine_to_floor"])
    real = taught.score([r["prompt"] for r in bad], [r["chosen"] for r in bad])
    other = taught.score([r["prompt"] for r in bad], [r["rejected"] for r in bad])
    assert np.mean(np.array(real) > np.array(other)) >= 0.95


def test_feature_scorer_learns_a_planted_cue():
    """Winners quote the post (a `>` line), losers do not: the fitted weight of quoted_lines is the largest."""
    rng = np.random.default_rng(0)
    vocab = "the a claim view post reason evidence because however people think".split()
    rows = []
    for i in range(60):
        text = lambda: " ".join(rng.choice(vocab, 30))  # noqa: E731
        prompt = [{"role": "user", "content": f"post {i}: " + text()}]
        rows.append({"prompt": prompt, "chosen": "> a line of the post\n\n" + text(), "rejected": text()})
    scorer = FeatureScorer.fit(rows)
    coefs = scorer.coefficients()
    assert max(coefs, key=lambda k: abs(coefs[k])) == "quoted_lines" and coefs["quoted_lines"] > 0
    chosen = scorer.score([r["prompt"] for r in rows], [r["chosen"] for r in rows])
    rejected = scorer.score([r["prompt"] for r in rows], [r["rejected"] for r in rows])
    assert all(c > r for c, r in zip(chosen, rejected))


def test_ensemble_z_scores_and_combines_fixed_scores():
    a, b = [1.0, 2.0, 3.0, 4.0], [10.0, 10.0, 30.0, 30.0]
    sa, sb = z_stats(a), z_stats(b)
    assert sa == {"mean": 2.5, "sd": pytest.approx(math.sqrt(1.25))} and sb == {"mean": 20.0, "sd": 10.0}
    assert z_stats([5.0, 5.0]) == {"mean": 5.0, "sd": 1.0}
    z = np.array([[-1.0, 0.5, 2.0], [1.0, 0.5, -1.0]])
    assert combine(z, "min").tolist() == [-1.0, 0.5, -1.0]
    assert combine(z, "mean_minus_std", 1.0).tolist() == pytest.approx([-1.0, 0.5, -1.0])
    assert combine(z, "mean_minus_std", 0.5).tolist() == pytest.approx([-0.5, 0.5, -0.25])
    assert combine(z, "mean_minus_std", 0.0).tolist() == pytest.approx([0.0, 0.5, 0.5])

    class Fixed:
        def __init__(self, scores, name):
            self.scores, self.name = scores, name

        def score(self, prompts, replies):
            return self.scores[: len(replies)]

    ens = EnsembleScorer([Fixed(a, "a"), Fixed(b, "b")], [sa, sb], "min", 1.0)
    za, zb = (np.array(a) - 2.5) / math.sqrt(1.25), (np.array(b) - 20.0) / 10.0
    assert ens.score([[]] * 4, ["r"] * 4) == pytest.approx(np.minimum(za, zb).tolist())


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    """A pairs run split by period, two feature judges on it (16 and 8 train pairs), one on another pairs run."""
    runs = tmp_path_factory.mktemp("features") / "runs"
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml",
                                 "--split_by", "period", "--runs_dir", runs))
    fit = lambda p, *a: run_dir_of(run_stage("03_train_reward.py", "--config",  # noqa: E731
                                             "configs/tiny/03_train_reward_features.yaml", "--pairs_run", p,
                                             "--runs_dir", runs, *a))
    other_pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/tiny/01_build_pairs.yaml",
                                       "--runs_dir", runs))
    return {"runs": runs, "pairs": pairs, "a": fit(pairs), "b": fit(pairs, "--max_train_examples", 8),
            "other": fit(other_pairs)}


def _ensemble(judges, *members, combine_="min"):
    return run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward_features.yaml",
                     "--judge_backbone", "ensemble", "--ensemble_of", *members, "--ensemble_combine", combine_,
                     "--pairs_run", judges["pairs"], "--runs_dir", judges["runs"], check=False)


@pytest.mark.stage
def test_feature_judge_trains_through_stage_03_and_reloads(judges):
    run = judges["a"]
    assert (run / "feature_judge.json").is_file() and not (run / "adapter").exists()
    audit = json.loads((run / "judge_audit.json").read_text())
    assert set(audit["feature_coefficients"]) == set(FEATURE_NAMES)
    assert {"length_only", "bag_of_words"} <= set(audit["baselines"]) and {"dev_later", "test"} <= set(audit["other_splits"])
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["judge"]["backbone"] == "features" and manifest["judge"]["features_version"] >= 1
    scorer = load_scorer(f"run:{run}")
    assert isinstance(scorer, FeatureScorer) and scorer.name == run.name
    dev = load_split(judges["pairs"], "dev")[:8]
    saved = [json.loads(line) for line in (run / "dev_scores.jsonl").read_text().splitlines()]
    again = scorer.score([r["prompt"] for r in dev], [r["chosen"] for r in dev])
    assert again == pytest.approx([s["chosen_score"] for s in saved]) and len(set(again)) > 1


@pytest.mark.stage
def test_feature_judge_trains_on_corruptions_and_ranks_them_lower(judges):
    """--corruptions: the (real over corrupted) pairs join the regression, counted in metrics.json; the gibberish
    audit then prefers the real reply at least as often as the judge fitted without them, for every kind it
    learnt to see (repeated and cut replies)."""
    run = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward_features.yaml",
                               "--pairs_run", judges["pairs"], "--runs_dir", judges["runs"], "--corruptions", "repeat",
                               "cut", "--corruption_share", "1", "--run_name", "Features_corruptions"))
    metrics = json.loads((run / "metrics.json").read_text())
    n_train = metrics["n_train_pairs"]
    assert metrics["corruption_pairs"]["repeat"] > n_train / 2 and metrics["corruption_pairs"]["cut"] > n_train / 2
    shares = {r: json.loads((r / "judge_audit.json").read_text())["corruption"]["kinds"] for r in (run, judges["a"])}
    for kind in ("repeat", "cut"):
        assert shares[run][kind]["share"] >= shares[judges["a"]][kind]["share"] and shares[run][kind]["share"] > 0.9


@pytest.mark.stage
def test_ensemble_of_judge_runs_is_built_audited_and_reloaded(judges, tmp_path):
    run = run_dir_of(_ensemble(judges, judges["a"], judges["b"], combine_="mean_minus_std"))
    saved = json.loads((run / "ensemble.json").read_text())
    assert [m["run_name"] for m in saved["members"]] == [judges["a"].name, judges["b"].name]
    assert saved["combine"] == "mean_minus_std" and all(m["z"]["sd"] > 0 for m in saved["members"])
    audit = json.loads((run / "judge_audit.json").read_text())
    assert audit["ensemble"]["members"][0]["artifacts_sha256"] == saved["members"][0]["artifacts_sha256"]
    posts = [json.loads((r / "train_posts.json").read_text())["posts"] for r in (judges["a"], judges["b"])]
    assert json.loads((run / "train_posts.json").read_text())["posts"] == sorted(set(posts[0]) | set(posts[1]))
    scorer = load_scorer(f"run:{run}")
    assert isinstance(scorer, EnsembleScorer) and [m.name for m in scorer.members] == [judges["a"].name, judges["b"].name]
    dev = load_split(judges["pairs"], "dev")[:8]
    prompts, replies = [r["prompt"] for r in dev], [r["chosen"] for r in dev]
    z = np.array([(np.array(load_scorer(f"run:{judges[k]}").score(prompts, replies)) - m["z"]["mean"]) / m["z"]["sd"]
                  for k, m in zip("ab", saved["members"])])
    assert scorer.score(prompts, replies) == pytest.approx((z.mean(0) - z.std(0)).tolist())
    rows = [json.loads(line) for line in (run / "dev_scores.jsonl").read_text().splitlines()]
    assert [r["chosen_score"] for r in rows] == pytest.approx(scorer.score(prompts, replies))


@pytest.mark.stage
def test_ensemble_refuses_a_judge_of_another_pairs_run(judges):
    before = sorted(judges["runs"].iterdir())
    line = error_line(_ensemble(judges, judges["a"], judges["other"]))
    assert judges["other"].name in line and "pairs run" in line
    assert sorted(judges["runs"].iterdir()) == before  # refused before any run directory was made


@pytest.mark.stage
def test_eval_takes_an_ensemble_and_refuses_a_changed_member(judges):
    run = run_dir_of(_ensemble(judges, judges["a"], judges["b"]))
    eval_run = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run",
                                    judges["pairs"], "--reward_run", run, "--max_premises", 2, "--max_new_tokens", 4,
                                    "--runs_dir", judges["runs"]))
    results = json.loads((eval_run / "eval.json").read_text())
    assert results["base"]["win_rate_vs_base"] == pytest.approx(0.5)
    manifest = json.loads((eval_run / "manifest.json").read_text())
    assert manifest["judge"]["backbone"] == "ensemble"
    # A member's fitted numbers changed (its own record rewritten to match): the ensemble's digest catches it.
    member = judges["b"]
    fitted = json.loads((member / "feature_judge.json").read_text())
    fitted["coef"] = [-c for c in fitted["coef"]]
    (member / "feature_judge.json").write_text(json.dumps(fitted))
    from common.provenance import artifact_digests
    recorded = json.loads((member / "manifest.json").read_text())
    recorded["artifacts"] = artifact_digests(member)
    (member / "manifest.json").write_text(json.dumps(recorded))
    with pytest.raises(RunError, match=f"{member.name}.*changed since the ensemble was built"):
        load_scorer(f"run:{run}")


@pytest.mark.parametrize("fields, field", [
    ({"judge_backbone": "features", "early_stopping_patience": 1}, "early_stopping_patience"),
    ({"judge_backbone": "ensemble", "ensemble_of": ["a", "b"], "train_also": ["dev"]}, "cross_fit_folds"),
    ({"judge_backbone": "ensemble", "ensemble_of": ["a"]}, "ensemble_of"),
    ({"judge_backbone": "features", "ensemble_of": ["a", "b"]}, "ensemble_of"),
    ({"judge_backbone": "ensemble", "ensemble_of": ["a", "b"], "corruptions": ["cut"]}, "corruptions"),
])
def test_settings_the_feature_judge_and_ensembles_cannot_use_are_refused(fields, field):
    from common.config import ConfigError, RewardStageConfig
    with pytest.raises(ConfigError, match=f"'{field}"):
        RewardStageConfig(model_name_or_path=".cache/models/tiny-llama3", pairs_run="p", **fields)
