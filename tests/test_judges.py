"""Several judges in stage 05 (common/judges.py): the report's line when a gain holds only under the
training judge. The stage itself, with two real judges and the overlap check, is in stages/test_pipeline.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.judges import gain_lines
from common.report import judges_section
from common.runs import RunError

JUDGES = {"R1": {"role": "training", "objective": "pairwise", "backbone": "lora_4bit", "model": "m", "train_split": "train"},
          "R2": {"role": "held_out", "objective": "pointwise", "backbone": "encoder", "model": "e", "train_split": "dev",
                 "family": "bert"},
          "R3": {"role": "other", "objective": "pairwise", "backbone": "encoder", "model": "e", "train_split": "train"}}


def _judged(rate, low, high):
    return {"reward_mean": 0.1, "win_rate_vs_base": rate, "win_rate_vs_base_ci95": [low, high],
            "lc_win_rate_vs_base": rate, "lc_win_rate_vs_base_ci95": [low, high]}


def _results(grpo_training, grpo_held_out, grpo_other=(0.5, 0.4, 0.6)):
    even = _judged(0.5, 0.5, 0.5)
    return {"base": {"by_judge": {"R1": even, "R2": even, "R3": even}},
            "grpo": {"by_judge": {"R1": _judged(*grpo_training), "R2": _judged(*grpo_held_out),
                                  "R3": _judged(*grpo_other)}}}


def test_a_gain_only_under_the_training_judge_is_flagged():
    (line,) = gain_lines(_results((0.8, 0.7, 0.9), (0.52, 0.4, 0.64)), JUDGES)
    assert line.startswith("**grpo beats the base under its training judge R1 (win rate 0.80 [0.70, 0.90]) but not "
                           "under the held-out judge R2 (0.52 [0.40, 0.64])**")
    # another judge on the policy's own posts (R3) is no held-out check: no line for it


def test_a_gain_that_holds_is_said_so_and_no_gain_says_nothing():
    (line,) = gain_lines(_results((0.8, 0.7, 0.9), (0.7, 0.6, 0.8)), JUDGES)
    assert "and the gain holds under the held-out judge R2" in line and "**" not in line
    assert gain_lines(_results((0.55, 0.45, 0.65), (0.3, 0.2, 0.4)), JUDGES) == []
    assert gain_lines(_results((0.8, 0.7, 0.9), (0.3, 0.2, 0.4)), {"R1": JUDGES["R1"]}) == []  # no held-out judge


def test_the_report_has_a_table_per_judge_and_the_lines():
    results = _results((0.8, 0.7, 0.9), (0.52, 0.4, 0.64))
    text = "\n".join(judges_section(results, JUDGES, gain_lines(results, JUDGES)))
    assert "**R2**: pointwise encoder judge (e, family bert), trained on the dev split; held out" in text
    assert "| grpo | 0.100 | 0.80 [0.70, 0.90] | 0.80 [0.70, 0.90] |" in text
    assert text.count("| model | reward (mean) |") == 3 and "but not under the held-out judge R2" in text
    assert "topic gate" not in text
    gated = {**JUDGES, "R2": {**JUDGES["R2"], "topic_gate": 10.0}}  # a gated judge (common/topic_gate.py) says so
    assert "(e, family bert, topic gate 10), trained" in "\n".join(judges_section(results, gated, []))


@pytest.mark.stage
@pytest.mark.parametrize("how", [lambda t: t.replace(" ", "  ", 1), lambda t: t.replace("\n", "\r\n") + " ",
                                 lambda t: t.replace(" ", "\u00a0", 3), lambda t: t.replace("o", "o\u200b", 2)],
                         ids=["doubled_space", "crlf", "nbsp", "zero_width"])
def test_a_judge_trained_on_the_scored_posts_in_disguise_is_refused(tmp_path, pairs_run, how):
    from common.cli import parse_config
    from common.config import RewardStageConfig
    from common.data import load_split
    from common.judges import describe_judges, write_train_posts
    from common.runs import RunError
    scored = load_split(pairs_run, "test")[:3]
    trained = [{**r, "group_id": f"renamed-{r['group_id']}",
                "prompt": [{**m, "content": how(m["content"])} for m in r["prompt"]]} for r in scored]
    judge = tmp_path / "Judge"
    judge.mkdir()
    write_train_posts(judge, "train", trained)
    config, _ = parse_config(RewardStageConfig, ["--config", "configs/tiny/03_train_reward.yaml", "--pairs_run", "p"])
    with pytest.raises(RunError, match=f"judge Judge trained on {len({r['group_id'] for r in scored})} of the"):
        describe_judges({"Judge": str(judge)}, None, scored, set(), {"Judge": config})
    other = load_split(pairs_run, "train")[:3]  # posts it never saw: held out
    assert describe_judges({"Judge": str(judge)}, None, other, set(), {"Judge": config})["Judge"]["role"] == "held_out"


# --- a judge trained on the scored premises ----------------------------------------------------------

def _judge(tmp_path, name: str, rows: list[dict], split: str = "train"):
    from common.judges import write_train_posts
    path = tmp_path / name
    path.mkdir()
    write_train_posts(path, split, rows)
    return str(path), SimpleNamespace(judge_objective="pairwise", judge_backbone="lora_4bit",
                                      judge_model_name_or_path=None, model_name_or_path="m", train_split=split,
                                      pairs_run=str(tmp_path / "its_pairs_run"))


def _premises(n: int) -> list[dict]:
    return [{"group_id": f"post{i}", "prompt": [{"role": "user", "content": f"premise {i}"}]} for i in range(n)]


def test_a_judge_trained_on_the_scored_posts_under_other_ids_is_refused(tmp_path):
    from common.judges import describe_judges
    scored = _premises(4)
    renamed = [{**p, "group_id": p["group_id"] + "_renamed"} for p in scored]
    own, own_config = _judge(tmp_path, "Dec01_Reward_Run1", _premises(8)[4:])
    other, other_config = _judge(tmp_path, "Dec01_Reward_Run2", renamed)
    with pytest.raises(RunError, match=f"--judge_runs {other}: judge Dec01_Reward_Run2 trained on 4 of the 4 premises"):
        describe_judges({"Dec01_Reward_Run1": own, "Dec01_Reward_Run2": other}, "Dec01_Reward_Run1", scored,
                        set(), {"Dec01_Reward_Run1": own_config, "Dec01_Reward_Run2": other_config})


def test_the_training_judge_is_refused_when_it_trained_on_the_scored_premises(tmp_path):
    from common.judges import describe_judges
    scored = _premises(4)
    judge, config = _judge(tmp_path, "Dec01_Reward_Run1", scored, split="test")
    with pytest.raises(RunError, match=f"--reward_run {judge}: judge Dec01_Reward_Run1 trained on 4 of the 4"):
        describe_judges({"Dec01_Reward_Run1": judge}, "Dec01_Reward_Run1", scored, set(), {"Dec01_Reward_Run1": config})
