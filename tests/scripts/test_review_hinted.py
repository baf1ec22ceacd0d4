"""scripts/review_hinted.sh: its wiring, with a stand-in interpreter that records each call, and the whole script on
the tiny review recipe."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, stand_in_interpreter

FAKE_PY = r'''# A stand-in interpreter: every stage "finishes" with a run directory named after its script.
script=$1; shift
echo "$script $*" >> "$CALLS"
runs=$RUNS_DIR
while (( $# )); do case $1 in --runs_dir) runs=$2; shift 2 ;; *) shift ;; esac; done
name=$(basename "$script" .py)_$RANDOM$RANDOM
mkdir -p "$runs/$name" && echo "run_dir: $runs/$name"
'''


def _calls(tmp_path, **env):
    fake = stand_in_interpreter(tmp_path, FAKE_PY)
    calls = tmp_path / "calls"
    proc = subprocess.run(["bash", "scripts/review_hinted.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": fake, "RUNS_DIR": str(tmp_path / "runs"), "CALLS": str(calls),
                               "RECIPE": "configs/tiny/review", **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line.split() for line in calls.read_text().splitlines()], proc.stdout


def _flag(call, name):
    return call[call.index(name) + 1] if name in call else None


def test_the_hinted_writer_is_evaluated_with_its_rating_model_and_beside_the_plain_one(tmp_path):
    calls, out = _calls(tmp_path, NOISE="0.3")
    sfts = [c for c in calls if c[0] == "02_train_sft.py"]
    assert [_flag(c, "--rating_hint_noise") for c in sfts] == ["0.3", None], sfts  # hinted first, then plain
    rating = next(c for c in calls if c[0] == "03_train_reward.py")
    evals = [c for c in calls if c[0] == "05_eval.py"]
    assert len(evals) == 3, evals
    dev, test_hinted, test_plain = evals
    # every eval is told the one rating model's ratings, at the same decoding
    rating_run = {_flag(c, "--rating_run") for c in evals}
    assert len(rating_run) == 1 and rating_run.pop().rsplit("/", 1)[1].startswith("03_train_reward"), evals
    assert {_flag(c, "--no_repeat_ngram_size") for c in evals} == {"5"}
    assert _flag(dev, "--split") == "dev" and _flag(test_hinted, "--split") is None
    # the blend is fitted on the hinted writer's dev reviews, and the hinted runs read the hinted writer
    assert _flag(test_hinted, "--rating_dev_run").rsplit("/", 1)[1].startswith("05_eval")
    assert _flag(dev, "--sft_run") == _flag(test_hinted, "--sft_run") != _flag(test_plain, "--sft_run")
    assert _flag(rating, "--config") == "configs/smol-gpu/review/03_train_rating.yaml"
    assert out.count("report.md") == 2


def test_plain_0_evaluates_the_hinted_writer_alone(tmp_path):
    calls, out = _calls(tmp_path, PLAIN="0", PAIRS_RUN=str(tmp_path / "pairs"))
    # the rating model and the hinted writer start together (in either order), the two evals after both
    assert sorted(c[0] for c in calls[:2]) == ["02_train_sft.py", "03_train_reward.py"], calls
    assert [c[0] for c in calls[2:]] == ["05_eval.py", "05_eval.py"], calls
    assert all(_flag(c, "--pairs_run") == str(tmp_path / "pairs") for c in calls)
    assert out.count("report.md") == 1


@pytest.mark.stage
def test_the_script_runs_on_the_tiny_recipe_and_only_the_hinted_evals_carry_the_hint(tiny_model, tmp_path):
    env = {**os.environ, "PY": sys.executable, "RUNS_DIR": str(tmp_path), "RECIPE": "configs/tiny/review",
           "RATING_CONFIG": "configs/tiny/review/03_train_rating.yaml",
           "EVAL_FLAGS": "--max_premises 6 --max_new_tokens 8"}  # 6 dev papers: enough to fit the blend's 4 weights
    proc = subprocess.run(["bash", "scripts/review_hinted.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = proc.stdout.strip().splitlines()[-1].removeprefix("reports: ").split()
    hinted, plain = (Path(report).parent for report in reports)
    assert (hinted / "DONE").exists() and (plain / "DONE").exists()
    manifest = json.loads((hinted / "manifest.json").read_text())
    assert manifest["rating_hint"]["sft_rating_hint_noise"] == 0.4
    assert "rating_hint" not in json.loads((plain / "manifest.json").read_text())
    # the hinted test eval has its base and the blend fitted on the hinted writer's dev reviews; the plain one neither
    sources = json.loads((hinted / "eval.json").read_text())["rating_sources"]
    assert {"base_parsed", "sft_parsed", "sft_blend", "rating_model"} <= set(sources)
    assert "sft_blend" not in json.loads((plain / "eval.json").read_text())["rating_sources"]
    # how far each writer wrote the rating it was told: measured where there was one to tell
    assert "hint" in json.loads((hinted / "eval.json").read_text())["sft"]
    assert "hint" not in json.loads((plain / "eval.json").read_text())["sft"]
