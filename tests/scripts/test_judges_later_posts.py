"""scripts/judges_later_posts.sh and scripts/judge_ensemble.py with stand-ins for the stages."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, stand_in_interpreter


def _judge_dir(path: Path, dev_later_accuracy: float) -> None:
    path.mkdir(parents=True)
    judged = {"n_pairs": 4, "accuracy": dev_later_accuracy, "accuracy_ci95": [0.0, 1.0]}
    audit = {"split": "dev_later", "judge": judged, "other_splits": {"dev": judged, "test": judged}, "periods": {},
             "baselines": {k: {f"{s}_accuracy": 0.5 for s in ("dev_later", "dev", "test")}
                           for k in ("length_only", "bag_of_words")}}
    for name, data in (("judge_audit.json", audit), ("metrics.json", {}),
                       ("manifest.json", {"pairs_run": "p", "stage": "Reward"})):
        (path / name).write_text(json.dumps(data))
    (path / "config.yaml").write_text((REPO / "configs/tiny/03_train_reward_features.yaml").read_text()
                                      .replace("pairs_run: null", "pairs_run: p"))


CANDIDATES = ("features", "minilm_pairwise", "minilm_pairwise_premise256", "minilm_pairwise_lr5e-5_3ep", "minilm_pairwise_seed7",
              "minilm_pointwise", "minilm_pairwise_reply_only", "smollm2_decoder", "smollm2_decoder_lr3e-4")


@pytest.mark.stage
@pytest.mark.parametrize("two_judge_ensemble", ["1", "0"])
def test_judges_later_posts_keeps_run_directories_with_spaces_whole(tmp_path, two_judge_ensemble):
    """The script's chain with stand-ins for the stages: the two best judges on dev_later reach the ensemble
    whole (none with TWO_JUDGE_ENSEMBLE=0, and the summary then reads none), and the best is printed whole."""
    runs = tmp_path / "my runs"
    for k, name in enumerate(CANDIDATES):
        _judge_dir(runs / f"Judge_{name}", (k + 1) / 10)
    fake = stand_in_interpreter(tmp_path, f"""case $1 in
  01_build_pairs.py) echo "run_dir: $RUNS_DIR/pairs run" ;;
  03_train_reward.py) while [[ $1 != --run_name ]]; do shift; done; echo "run_dir: $RUNS_DIR/$2" ;;
  scripts/judges_later_posts.py) if [[ $2 == best* ]]; then exec "{sys.executable}" "$@"; fi
                                 [[ $2 == summary ]] && printf '%s\n' "${{@:3}}" > "{tmp_path}/summary_args" ;;
  scripts/judge_ensemble.py) printf '%s\\n' "${{@:2}}" > "{tmp_path}/ensemble_args" ;;
esac
""")
    env = {**os.environ, "PY": fake, "RUNS_DIR": str(runs), "RECIPE_03": "configs/tiny",
           "TWO_JUDGE_ENSEMBLE": two_judge_ensemble}
    proc = subprocess.run(["bash", "scripts/judges_later_posts.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary_args = (tmp_path / "summary_args").read_text().splitlines()
    if two_judge_ensemble == "1":
        assert (tmp_path / "ensemble_args").read_text().splitlines()[:2] == [
            str(runs / "Judge_smollm2_decoder_lr3e-4"), str(runs / "Judge_smollm2_decoder")]
        assert summary_args[-2:] == ["--ensemble", str(runs / "judges_later_posts_ensemble.json")]
    else:
        assert not (tmp_path / "ensemble_args").exists() and "--ensemble" not in summary_args
        assert summary_args[0] == str(runs) and all("=" in arg for arg in summary_args[1:])  # the folder, the judges
    assert proc.stdout.strip().splitlines()[-1] == f"best: smollm2_decoder_lr3e-4 {runs / 'Judge_smollm2_decoder_lr3e-4'}"


@pytest.mark.slow
def test_judge_ensemble_of_an_unfinished_run_is_one_error_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/judge_ensemble.py", str(tmp_path / "a b"), str(tmp_path / "c")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == f"error: input {tmp_path / 'a b'} does not exist (no such file or run directory)"


@pytest.mark.stage
def test_judge_ensemble_takes_feature_judges(tmp_path):
    """scripts/judge_ensemble.py loads each run through the Scorer seam: a feature judge is one of the two best."""
    from conftest import run_dir_of, run_stage
    pairs = run_dir_of(run_stage("01_build_pairs.py", "--config", "configs/smol/01_build_pairs.yaml",
                                 "--runs_dir", str(tmp_path)))
    judges = [run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward_features.yaml",
                                   "--pairs_run", str(pairs), "--seed", str(seed), "--runs_dir", str(tmp_path),
                                   "--run_name", f"Features_{seed}")) for seed in (1, 2)]
    proc = subprocess.run([sys.executable, "scripts/judge_ensemble.py", *map(str, judges), "--out",
                           str(tmp_path / "ensemble.json")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "ensemble.json").read_text())
    assert out["runs"] == ["Features_1", "Features_2"] and 0 <= out["test"]["ensemble"]["accuracy"] <= 1


def _audited_judge(path: Path, right: list[bool], weakest_kind_share: float) -> str:
    """A judge run as `best` reads it: per-pair dev_later scores (`right`: the winner scored higher) and the
    gibberish audit's shares on dev_later."""
    _judge_dir(path, sum(right) / len(right))
    audit = json.loads((path / "judge_audit.json").read_text())
    audit["corruption"] = {"kinds": {"salad": {"by_split": {"dev_later": {"share": weakest_kind_share}}},
                                     "shuffle": {"by_split": {"dev_later": {"share": 1.0}}}}}
    (path / "judge_audit.json").write_text(json.dumps(audit))
    (path / "dev_later_scores.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "chosen_score": 1.0 if ok else 0.0, "rejected_score": 0.5}) + "\n"
        for i, ok in enumerate(right)))
    return f"{path.name}={path}"


def test_without_a_judge_that_passes_the_audit_the_hardest_to_fool_of_those_level_with_the_best_is_taken(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from judges_later_posts import best
    n = 60
    top = [i % 5 != 0 for i in range(n)]  # 0.80
    level = [i % 5 != 0 and i != 1 and i != 2 for i in range(n)]  # 0.77: not shown below the best
    worse = [i % 3 == 0 for i in range(n)]  # 0.33: shown below it
    items = [_audited_judge(tmp_path / "top", top, 0.10), _audited_judge(tmp_path / "level", level, 0.60),
             _audited_judge(tmp_path / "worse", worse, 0.95)]
    assert best(items)[0] == "level"
    # a judge that passes the audit is taken before any that does not, however well the others rank
    items.append(_audited_judge(tmp_path / "passes", worse, 0.99))
    assert best(items)[0] == "passes"
    # without per-pair scores no judge is shown level with the best: the best is taken
    for name in ("level", "worse", "passes"):
        (tmp_path / name / "dev_later_scores.jsonl").unlink()
    (tmp_path / "passes" / "judge_audit.json").write_text(
        (tmp_path / "passes" / "judge_audit.json").read_text().replace("0.99", "0.5"))
    assert best(items)[0] == "top"


def test_a_judge_trained_after_the_summary_gets_its_lever_row_and_the_training_judge_stays(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    from judges_later_posts import add_lever, summary
    n = 40
    first = _audited_judge(tmp_path / "a", [i % 4 != 0 for i in range(n)], 0.2)  # 0.75
    out = summary(tmp_path, [first, _audited_judge(tmp_path / "b", [i % 2 == 0 for i in range(n)], 0.1)], None)
    assert out["judges"]["a"]["default"]
    hardened = _audited_judge(tmp_path / "a+hard_negatives", [True] * n, 0.9)  # 1.00
    out = add_lever(tmp_path, "hard negatives", hardened, first)
    row = out["levers"][-1]
    assert (row["lever"], row["judge"], row["against"], row["n_pairs"]) == ("hard negatives", "a+hard_negatives", "a", n)
    assert row["gain"] == pytest.approx(0.25) and row["gain_ci95"][0] > 0
    assert out["judges"]["a"]["default"] and "default" not in out["judges"]["a+hard_negatives"]
    assert "| hard negatives | a+hard_negatives | a | 40 |" in (tmp_path / "judges_later_posts.md").read_text()


def test_a_topic_gate_is_read_on_the_same_judge_and_its_twin_shows_trainings_noise(tmp_path):
    """The gate's row compares the gated judge with its own scores without the gate (no second training in
    between); the plain twin, trained apart, gets a row against that same ungated judge."""
    sys.path.insert(0, str(REPO / "scripts"))
    from judges_later_posts import levers
    n = 40
    own = [i % 4 != 0 for i in range(n)]  # the gated judge's own ranking, without its gate: 0.75
    gated = [ok and i not in (1, 2) for i, ok in enumerate(own)]  # the gate costs two pairs: 0.70
    twin = [i % 2 == 0 for i in range(n)]  # the same recipe trained again: 0.50
    items = [_audited_judge(tmp_path / "a", twin, 0.5), _audited_judge(tmp_path / "a+topic_gate_10", gated, 0.9)]
    path = tmp_path / "a+topic_gate_10" / "dev_later_scores.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "chosen_ungated": 1.0 if ok else 0.0, "rejected_ungated": 0.5}) + "\n"
                            for r, ok in zip(rows, own)))
    accuracy = {"dev_later": {"accuracy": 0.0, "accuracy_ci95": [0, 1]}, "test": {"accuracy": 0.0, "accuracy_ci95": [0, 1]}}
    table = {(r["lever"], r["judge"], r["against"]): r for r in levers(items, {"a": accuracy, "a+topic_gate_10": accuracy})}
    gate = table[("topic gate 10", "a+topic_gate_10", "a+topic_gate_10 without its gate")]
    assert gate["gain"] == pytest.approx(-2 / n) and gate["against_accuracy"] == pytest.approx(0.75)
    second = table[("a second training of the same recipe", "a", "a+topic_gate_10 without its gate")]
    assert second["gain"] == pytest.approx(0.5 - 0.75)
    assert len(table) == 2  # not the gated judge against its twin: that mixes the gate with a second training
    # A gated run written before its ungated scores were: read against the twin, as any lever
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["judge"], r["against"]) for r in levers(items, {"a": accuracy, "a+topic_gate_10": accuracy})] == [
        ("a+topic_gate_10", "a")]
