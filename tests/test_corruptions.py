"""Corruptions of real replies (common/corruptions.py), stage 03's --corruptions and --hard_negatives, and
the gibberish audit: a judge that prefers word salad fails it, one trained on corruptions does better."""
from __future__ import annotations

import json
import typing
from collections import Counter

import pytest
from conftest import error_line, run_dir_of, run_in_process, run_stage, tiny_bert

from common.config import RewardStageConfig
from common.corruptions import KINDS, TARGET, corrupt, corrupted, corruption_audit, corruption_pairs
from common.data import SENTENCE_END, load_split
from common.scorers import FunctionScorer
from common.watch import distinct_n

REPLY = ("Rent control helps tenants who already have a lease. It also shrinks the supply of new housing! "
         "Over time, that pushes rents up for everyone else. So the policy hurts the people it means to help.")
PREMISE = "CMV: rent control is good policy for expensive cities with long waiting lists of renters"
OTHERS = ["Cats are better pets than dogs because they need less of your time.", REPLY]


def corrupted_reply(kind, seed=0):
    return corrupt(kind, REPLY, PREMISE, OTHERS, seed)


def test_shuffle_keeps_the_words_in_another_order():
    out = corrupted_reply("shuffle")
    assert Counter(out.split()) == Counter(REPLY.split()) and out.split() != REPLY.split()
    assert corrupted_reply("shuffle") == out and corrupted_reply("shuffle", seed=1) != out  # seeded


def test_salad_draws_the_replys_own_words_to_its_length():
    out = corrupted_reply("salad")
    assert len(out.split()) == len(REPLY.split()) and set(out.split()) <= set(REPLY.split())
    assert out.split() != REPLY.split() and Counter(out.split()) != Counter(REPLY.split())  # drawn, not permuted
    assert corrupted_reply("salad") == out


def test_repeat_is_one_sentence_again_and_again_to_the_replys_length():
    out = corrupted_reply("repeat")
    assert len(out.split()) == len(REPLY.split())
    sentence = next(s for s in SENTENCE_END.split(REPLY) if out.startswith(s))
    assert out.count(sentence) >= 2 and out != REPLY
    one = "Short replies like this one still get a repeated unit of their own words"
    assert corrupt("repeat", one) != one and set(corrupt("repeat", one).split()) < set(one.split())


def test_premise_copy_is_the_premise_cut_to_the_replys_length():
    long_premise = PREMISE + " " + " ".join(f"word{i}" for i in range(100))
    out = corrupt("premise_copy", REPLY, long_premise)
    assert out.split() == long_premise.split()[: len(REPLY.split())]
    assert corrupted_reply("premise_copy") == PREMISE  # a shorter premise: all of it


def test_other_post_is_a_real_reply_to_another_post():
    assert corrupted_reply("other_post") == OTHERS[0]  # never the reply itself
    with pytest.raises(ValueError, match="another post"):
        corrupt("other_post", REPLY, PREMISE, [REPLY])


def test_cut_stops_mid_sentence_near_half_way():
    out = corrupted_reply("cut")
    n = len(REPLY.split())
    assert REPLY.startswith(out) and abs(len(out.split()) - n // 2) <= 2
    assert not out.endswith((".", "!", "?"))
    every_word_ends = "One. Two. Three. Four. Five. Six."
    assert not corrupt("cut", every_word_ends).endswith(".")


def test_the_config_knows_every_kind():
    hint = typing.get_type_hints(RewardStageConfig)["corruptions"]
    assert set(typing.get_args(typing.get_args(hint)[0])) == set(KINDS)
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt("gibberish", REPLY)


# --- pairs and the audit on the tiny pairs run -----------------------------------------------------

@pytest.mark.stage
def test_corruption_pairs_are_real_over_corrupted_and_counted(pairs_run):
    rows = load_split(pairs_run, "train")[:20]
    pairs, counts = corruption_pairs(rows, KINDS, seed=3, share=0.5)
    assert counts["corruption_pairs"] == dict.fromkeys(KINDS, 10) and len(pairs) == 60
    assert all(counts["corruption_pairs_skipped"][k] == 0 for k in KINDS)
    originals = {(r["id"], key): r[key] for r in rows for key in ("chosen", "rejected")}
    for p in pairs:
        source = rows[p["row"]]
        assert p["chosen"] == originals[(source["id"], p["real"])] and p["rejected"] != p["chosen"]
        assert p["group_id"] == source["group_id"] and p["prompt"] == source["prompt"]
    assert corruption_pairs(rows, KINDS, seed=3, share=0.5)[0] == pairs  # seeded
    other = [p for p in pairs if p["negative"] == "other_post"]
    replies_by_post = {(r["group_id"], r[k]) for r in rows for k in ("chosen", "rejected")}
    assert all((p["group_id"], p["rejected"]) not in replies_by_post for p in other)
    every, _ = corrupted(rows, "salad", seed=0)
    assert len(every) == 2 * len(rows)  # no share: the winner and the loser of every pair


def salad_lover(prompts, replies):
    """The judge GRPO found: distinct word pairs (salad and shuffled words have more of them)."""
    return [distinct_n([r], 2) for r in replies]


@pytest.mark.stage
def test_a_judge_that_prefers_salad_fails_the_audit(pairs_run):
    test = load_split(pairs_run, "test")[:24]
    result = corruption_audit(FunctionScorer(salad_lover), {"test": test}, seed=0)
    assert set(result["kinds"]) == set(KINDS) and result["splits"] == {"test": 24}
    for kind in ("salad", "shuffle"):
        entry = result["kinds"][kind]
        assert entry["share"] < 0.3 and entry["n"] == 48, (kind, entry)
        assert entry["share_ci95"][0] <= entry["share"] <= entry["share_ci95"][1] < TARGET
    assert result["min_over_kinds"] < 0.3 and not result["passes"]
    assert result["min_over_kinds"] == min(v["share"] for v in result["kinds"].values())


@pytest.mark.stage
def test_a_judge_that_knows_the_real_replies_passes_the_audit(pairs_run):
    test = load_split(pairs_run, "test")[:24]
    real = {(json.dumps(r["prompt"]), r[k]) for r in test for k in ("chosen", "rejected")}

    def knows(prompts, replies):
        return [float((json.dumps(p), r) in real) for p, r in zip(prompts, replies)]
    result = corruption_audit(knows, {"test": test}, seed=0)
    assert result["min_over_kinds"] == 1.0 and result["passes"]  # other_post is real, but not for this post


# --- stage 03 ---------------------------------------------------------------------------------------

ENCODER = ["--config", "configs/tiny/03_train_reward.yaml", "--judge_backbone", "encoder", "--max_prompt_tokens", 32,
           "--max_length", 96, "--learning_rate", "1e-3", "--max_train_examples", 32,
           "--max_eval_examples", 16]


@pytest.fixture(scope="module")
def judges(pairs_run, tmp_path_factory):
    """A tiny encoder judge trained without and with every corruption (20 steps each, seconds)."""
    root = tmp_path_factory.mktemp("hardening")
    bert, runs = tiny_bert(root), root / "runs"
    common = [*ENCODER, "--pairs_run", pairs_run, "--judge_model_name_or_path", bert, "--runs_dir", runs]
    plain = run_dir_of(run_stage("03_train_reward.py", *common, "--max_steps", 20))
    hardened = run_dir_of(run_stage("03_train_reward.py", *common, "--max_steps", 20, "--corruptions", *KINDS,
                                    "--corruption_share", 0.5))
    return {"plain": plain, "hardened": hardened, "bert": bert, "runs": runs, "common": [*common, "--max_steps", 2]}


@pytest.mark.stage
def test_corruptions_are_trained_on_counted_and_audited(judges):
    metrics = json.loads((judges["hardened"] / "metrics.json").read_text())
    assert metrics["corruption_pairs"] == dict.fromkeys(KINDS, 16)  # 0.5 x 32 train pairs each
    assert metrics["n_train_pairs"] == 32 and metrics["hard_negative_pairs"] == {}
    audit = json.loads((judges["hardened"] / "judge_audit.json").read_text())["corruption"]
    assert audit["splits"] == {"test": 16} and set(audit["kinds"]) == set(KINDS)
    assert metrics["judge_audit"]["corruption"]["min_over_kinds"] == audit["min_over_kinds"]
    assert "Gibberish audit" in json.loads((judges["hardened"] / "judge_audit.json").read_text())["verdict"]["text"]
    assert "corruption_pairs" not in json.loads((judges["plain"] / "metrics.json").read_text())


@pytest.mark.stage
def test_a_judge_trained_on_corruptions_prefers_real_replies_more_often(judges):
    """20 steps of a random 2-layer BERT learn the easy kinds (a cut reply, the premise copied back), not
    yet word order: the audit must see the difference, not the 0.98 target."""
    plain, hardened = ({k: v["share"] for k, v in json.loads((judges[name] / "judge_audit.json").read_text())
                        ["corruption"]["kinds"].items()} for name in ("plain", "hardened"))
    assert sum(hardened.values()) / len(KINDS) > sum(plain.values()) / len(KINDS) + 0.1, (plain, hardened)
    assert min(hardened.values()) > min(plain.values()) and hardened["cut"] > plain["cut"] + 0.5


@pytest.mark.stage
def test_hard_negatives_from_training_posts_join_and_from_held_out_posts_are_refused(judges, pairs_run):
    runs = judges["runs"]
    on_train = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                                    "--split", "train", "--max_premises", 3, "--runs_dir", runs))
    on_test = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                                   "--max_premises", 3, "--runs_dir", runs))
    run = run_dir_of(run_stage("03_train_reward.py", *judges["common"], "--hard_negatives", f"{on_train}:base"))
    metrics = json.loads((run / "metrics.json").read_text())
    train = load_split(pairs_run, "train")
    premises = [json.loads(line) for line in (on_train / "replies.jsonl").read_text().splitlines()]
    posts = {r["group_id"] for r in train if r["id"] in {p["id"] for p in premises}}
    winners = {(r["group_id"], r["chosen"]) for r in train if r["group_id"] in posts}
    assert metrics["hard_negative_pairs"] == {f"{on_train.name}:base": len(winners)}
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["inputs"]["hard_negatives[0]"]["stage"] == "Eval" and manifest["hard_negatives"]
    assert posts <= set(json.loads((run / "train_posts.json").read_text())["posts"])
    # the test split's posts are where the judge is measured (in process: refused before any model loads)
    line = error_line(run_in_process("03_train_reward.py", *judges["common"], "--hard_negatives", f"{on_test}:base"))
    assert str(on_test) in line and "3 of its 3 premises" in line and "test" in line
    # a judge trained on dev (held out): the train split's posts are no longer its own
    line = error_line(run_in_process("03_train_reward.py", *judges["common"], "--train_split", "dev",
                                     "--audit_split", "test", "--hard_negatives", f"{on_train}:base"))
    assert "3 of its 3 premises" in line and "(train;" in line
    line = error_line(run_in_process("03_train_reward.py", *judges["common"], "--hard_negatives", f"{on_train}:nobody"))
    assert "no model 'nobody'" in line and "base" in line
    line = error_line(run_in_process("03_train_reward.py", *judges["common"], "--hard_negatives", str(on_train)))
    assert "names no model" in line


@pytest.mark.stage
def test_pointwise_takes_a_corruption_as_one_no_delta_example_made_of_what_the_judge_reads(pairs_run, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from common.model import ENCODER as ENCODER_KIND
    from common.rewards import RewardScorer, pointwise_dataset
    bert = tiny_bert(tmp_path)
    scorer = RewardScorer(AutoModelForSequenceClassification.from_pretrained(bert), AutoTokenizer.from_pretrained(bert),
                          32, 96, kind=ENCODER_KIND)
    rows = load_split(pairs_run, "train")[:4]
    bad, _ = corruption_pairs(rows, ["cut"], seed=0, share=1.0, visible=scorer.visible_reply)
    data = pointwise_dataset(rows + bad, scorer)
    assert data["labels"] == [1.0, 0.0] * 4 + [0.0] * 4  # the real reply is not added twice
    assert data[8]["input_ids"] == scorer.encode(bad[0]["prompt"], bad[0]["rejected"])
    for pair in bad:  # the cut is of the visible part, so the judge sees two different inputs
        seen = scorer.visible_reply(pair["prompt"], pair["chosen"])
        assert seen.startswith(pair["rejected"]) and len(pair["rejected"]) < len(seen)
        assert scorer.encode(pair["prompt"], pair["rejected"]) != scorer.encode(pair["prompt"], pair["chosen"])
    assert any(len(scorer.visible_reply(r["prompt"], r["chosen"])) < len(r["chosen"]) for r in rows)
