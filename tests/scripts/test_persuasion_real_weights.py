"""scripts/persuasion_real_weights.sh in its CPU mode (the tiny recipe): every stage runs, and the
comparison table (per model and judge, vs base and vs SFT, with intervals) is written."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, tiny_bert

pytestmark = pytest.mark.stage  # every test here runs stage scripts (tests/README.md)


def test_the_persuasion_script_runs_every_stage_and_writes_the_comparison(tiny_model, tmp_path):
    bert = tiny_bert(tmp_path)
    # One judge candidate of each family (the whole sweep has its own test: tests/stages/test_period_split.py)
    # and two GRPO recipes, the plain one and the anchored, gated one.
    candidates = tmp_path / "candidates.txt"
    candidates.write_text(f"features --config configs/tiny/03_train_reward_features.yaml\n"
                          f"minilm_pointwise --config configs/tiny/03_train_reward_minilm_pointwise.yaml "
                          f"--judge_model_name_or_path {bert}\n"
                          f"smollm2_decoder_lr3e-4 --config configs/tiny/03_train_reward_smol.yaml --learning_rate 3e-4\n")
    env = {**os.environ, "RECIPE": "configs/tiny", "PAIRS_CONFIG": "configs/smol/01_build_pairs.yaml", "MAX_PREMISES": "6",
           "RUNS_DIR": str(tmp_path), "SUMMARY_DIR": str(tmp_path / "summary"), "MINILM": str(bert),
           "PY": sys.executable, "BEST_OF_N": "2", "FLUENCY_MODEL": str(tiny_model), "BUILTIN": "0",
           "CANDIDATES_FILE": str(candidates), "ENSEMBLE_SIZES": "", "GRPO_ONLY": "lr1e-4 par_fluency_gate"}
    with open(tmp_path / "chain.log", "w") as log:  # the chain's output to a file, as sbatch --output has it
        proc = subprocess.run(["bash", "scripts/persuasion_real_weights.sh"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, text=True)
    text = (tmp_path / "chain.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    # every stage's lines are in the log, not only the last one's
    assert "run_dir: " in text.split("training judge (chosen on dev_later)")[0] and "finished in" in text
    summary = json.loads((tmp_path / "summary" / "persuasion_real_weights.json").read_text())
    models = list(summary["models"])
    assert models[:3] == ["base", "sft", "grpo"] and {"grpo_from_base", "dpo", "orpo", "raft", "best_of_n"} <= set(models)
    judges = summary["judges"]
    training = next(j for j in judges.values() if j["role"] == "training")
    held_out = [j for j in judges.values() if j["role"] == "held_out"]
    # the cross-fit and the dev judge in the training judge's recipe, a dev judge in each of two other families'
    assert len(held_out) == 4 and len(judges) == 5
    assert len({j["family"] for j in held_out}) == 3 and training["family"] in {j["family"] for j in held_out}
    crossfit = next(j for name, j in summary["judges"].items() if name.endswith("_crossfit"))
    assert len(crossfit["runs"]) == 2 and crossfit["n_pairs"] > 0
    for name, model in summary["models"].items():
        assert model["n"] == summary["n_premises"]
        assert {"looped_share", "premise_copy_share", "distinct_2"} <= set(model)
        for judge in summary["judges"]:
            scored = model["by_judge"][judge]
            low, high = scored["win_rate_vs_base_ci95"]
            assert low <= scored["win_rate_vs_base"] <= high and "lc_win_rate_vs_base_ci95" in scored
            assert ("win_rate_vs_sft" in scored) == (name not in ("base", "sft")), name
    assert set(summary["grpo_recipes"]) == {"lr1e-4", "par_fluency_gate"}
    assert all(c["rewards"] for c in summary["grpo_recipes"].values())
    gated = json.loads((tmp_path / summary['grpo_recipes']['par_fluency_gate']['run'] / 'metrics.json').read_text())
    assert {"rewards/par/mean", "rewards/fluency_gate/mean"} <= set(gated["log_history"][0]), gated["log_history"][0]
    assert gated["checkpoint_choice"]["chosen_step"] in [c["step"] for c in gated["checkpoint_choice"]["curve"]]
    per_model = [line for line in summary["verdict"] if line.startswith("**") and line[2:].split("**")[0] in models]
    assert len(per_model) == len(models) - 1  # every model but the base; then the family and fluency lines
    assert any(line.startswith("Fluency: each reply's mean token log-probability") for line in summary["verdict"])
    sweep = json.loads((tmp_path / "summary" / "persuasion_decoding_sweep.json").read_text())
    assert sweep["split"] == "dev" and sweep["chosen"] in sweep["decodings"] and len(sweep["decodings"]) == 5
    chosen = sweep["decodings"][sweep["chosen"]]
    assert summary["decoding"]["temperature"] == chosen["temperature"]
    judges = json.loads((tmp_path / "summary" / "judges_later_posts.json").read_text())
    assert sum(bool(j.get("default")) for j in judges["judges"].values()) == 1
    assert {"bag_of_words", "length_only"} == set(judges["baselines"])
    for row in judges["judges"].values():
        for split in ("dev_later", "test"):
            assert 0 <= row[split]["accuracy_ci95"][0] <= row[split]["accuracy"] <= row[split]["accuracy_ci95"][1]
    report = text.strip().splitlines()[-1].split(" ", 1)[1]
    assert "## Verdict" in open(report).read()



FAKE_PY = r'''#!/usr/bin/env bash
# A stand-in interpreter: every stage "finishes" with a run directory, except those FAIL names (a crash)
# and those GUARD names (stopped by the length guard); the helper scripts print what the chain reads.
script=$1; shift
command=${1:-}  # a helper script's subcommand, before the loop below takes the arguments
runs=$RUNS_DIR; name=""
while (( $# )); do case $1 in --runs_dir) runs=$2; shift 2 ;; --run_name) name=$2; shift 2 ;; *) shift ;; esac; done
case $script in
  scripts/judges_later_posts.py) case $command in best) echo "best: j $runs/Judge" ;; best2) printf '%s\n' a b ;; esac; exit 0 ;;
  scripts/persuasion_real_weights.py) case $command in decoding) echo "--temperature 0" ;; rising) ls -d "$runs"/GRPO_* ;; esac; exit 0 ;;
  scripts/*) exit 0 ;;
esac
name=${name:-$(basename "$script" .py)_$RANDOM$RANDOM}
if [[ " $FAIL " == *" $script "* || " $FAIL " == *" $name "* ]]; then echo "Traceback: boom" >&2; exit 1; fi
if [[ " $GUARD " == *" $name "* ]]; then echo "error: reward-hacking guard: mean reply length" >&2; exit 1; fi
mkdir -p "$runs/$name" && echo "run_dir: $runs/$name"
'''


def _chain(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "scripts/persuasion_real_weights.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": str(fake), "RUNS_DIR": str(tmp_path / "runs"), "FAIL": "",
                               "GUARD": "", **env}, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


GRPO = ["GRPO_lr2e-5", "GRPO_lr1e-4", "GRPO_lr1e-4_beta0.04_temperature0.8", "GRPO_lr3e-4_unscaled"]


@pytest.mark.parametrize("fail, guard, ok", [
    (" ".join(GRPO), "", False), ("04_train_grpo.py", "", False), ("04_train_dpo.py", "", False),
    (GRPO[0], "", False), ("", " ".join(GRPO[:3]), True), ("", "", True)])
def test_the_chain_fails_when_a_stage_fails_and_names_it(tmp_path, fail, guard, ok):
    code, out = _chain(tmp_path, FAIL=fail, GUARD=guard)
    assert (code == 0) == ok, out[-3000:]
    assert ("finished in" in out) == ok, out[-3000:]
    for name in guard.split():
        assert f"stage grpo_{name[5:]} was stopped by its length guard" in out
    if not ok:
        assert "error: " in out and ("failed" in out or "no GRPO recipe finished" in out), out[-3000:]
        failed = [g for g in GRPO if g in fail or fail == "04_train_grpo.py"]
        for name in failed:
            assert f"stage grpo_{name[5:]} failed" in out, out[-3000:]


def test_the_judges_second_round_trains_on_the_practised_policys_replies(tmp_path):
    """HARD_NEGATIVES=1: the rising GRPO policy answers train premises, the training judge's recipe trains
    again on those replies as losers (a feature judge too), and an ensemble (which trains nothing) skips the step."""
    code, out = _chain(tmp_path, HARD_NEGATIVES="1")
    assert code == 0, out[-3000:]
    runs = tmp_path / "runs"
    assert (runs / "HardNegative_Replies").is_dir() and (runs / "Judge_j+hard_negatives").is_dir(), out[-3000:]
    # the timeline (one line a finished stage, in the order they finished): the eval does not wait for the
    # second round, which trains only once the eval is written
    timeline = [line.split("\t") for line in (runs / "logs" / "timeline.tsv").read_text().splitlines()]
    names = [row[0] for row in timeline]
    assert {"sft", "dpo", "orpo", "raft", "hard_replies", "05_eval.py", "hard_negatives"} <= set(names), names
    assert names.index("05_eval.py") < names.index("hard_negatives") and names[-1] == "hard_negatives"
    assert all(int(start) <= int(end) and status == "0" for _, start, end, status in timeline)
    shutil.rmtree(runs)
    (runs / "Judge").mkdir(parents=True)
    (runs / "Judge" / "config.yaml").write_text("judge_backbone: ensemble\n")
    code, out = _chain(tmp_path, HARD_NEGATIVES="1")
    assert code == 0 and "hard negatives: the training judge (j, ensemble) trains on no extra pairs" in out
    assert not (runs / "HardNegative_Replies").exists()
