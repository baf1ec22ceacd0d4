"""scripts/review_real_weights.sh's switches, with a stand-in interpreter that records each call (the whole chain on
the tiny model has its own test: tests/test_readout.py)."""
from __future__ import annotations

import os
import subprocess

from conftest import REPO, stand_in_interpreter

FAKE_PY = r'''# A stand-in interpreter: every stage "finishes" with a run directory; the helper script prints what the chain reads.
script=$1; shift
echo "$script $*" >> "$CALLS"
command=${1:-} first=${2:-}
runs=$RUNS_DIR
while (( $# )); do case $1 in --runs_dir) runs=$2; shift 2 ;; *) shift ;; esac; done
case $script in
  scripts/review_real_weights.py) [[ $command == pick ]] && printf '%s\n' "--temperature 0" \
    "--reading ${PICK_READING:-first_window}" "$first"
    exit 0 ;;
  -c) echo "$first"; exit 0 ;;  # the rating model of lowest dev MAE: the first
esac
name=$(basename "$script" .py)_$RANDOM$RANDOM
mkdir -p "$runs/$name" && echo "run_dir: $runs/$name"
'''


def _chain(tmp_path, **env):
    fake = stand_in_interpreter(tmp_path, FAKE_PY)
    calls = tmp_path / "calls"
    proc = subprocess.run(["bash", "scripts/review_real_weights.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": fake, "RUNS_DIR": str(tmp_path / "runs"), "CALLS": str(calls),
                               "RATING_CONFIGS": "", "DECODINGS": "--temperature 0", **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return calls.read_text().splitlines()


def _test_eval(calls):
    return next(line for line in calls if line.startswith("05_eval.py") and "--split dev" not in line)


def test_the_chain_trains_both_dpos_and_orpo_and_evaluates_them(tmp_path):
    calls = _chain(tmp_path)
    preference = [line for line in calls if line.startswith("04_train_dpo.py")]
    assert len(preference) == 3 and sum("--loss orpo" in line for line in preference) == 1, preference
    policies = _test_eval(calls).split("--policy_runs ")[1].split(" --")[0].split()
    assert [p.rsplit("/", 1)[1].rsplit("_", 1)[0] for p in policies] == ["04_train_dpo"] * 3, policies


def test_preference_0_skips_both_dpos_and_orpo_and_evaluates_sft_alone(tmp_path):
    calls = _chain(tmp_path, PREFERENCE="0")
    assert not any(line.startswith("04_train_dpo.py") for line in calls), calls
    evaluated = _test_eval(calls)
    assert "--policy_runs" not in evaluated and "--sft_run" in evaluated, evaluated
    assert calls[-1].startswith("scripts/review_real_weights.py summary"), calls


def _blend_dev_runs(tmp_path, reading):
    """The chain with a rating model: its dev evals of SFT, the run the pick read, and the test eval's
    --rating_dev_run."""
    calls = _chain(tmp_path, PREFERENCE="0", PICK_READING=reading,
                   RATING_CONFIGS="configs/tiny/review/03_train_rating.yaml")
    dev = [line for line in calls if line.startswith("05_eval.py") and "--split dev" in line]
    picked = next(line for line in calls if line.startswith("scripts/review_real_weights.py pick")).split()[-1]
    return dev, picked, _test_eval(calls).split("--rating_dev_run ")[1].split()[0]


def test_a_pick_that_reads_all_windows_fits_the_blend_on_the_sweeps_own_run(tmp_path):
    dev, picked, blend_dev = _blend_dev_runs(tmp_path, "all_windows")
    assert len(dev) == 1 and "--reading all_windows" in dev[0], dev  # the sweep's, no second one
    assert blend_dev == picked


def test_a_pick_that_reads_the_first_window_evaluates_dev_again_at_that_reading(tmp_path):
    dev, picked, blend_dev = _blend_dev_runs(tmp_path, "first_window")
    assert len(dev) == 2 and "--reading first_window" in dev[1], dev
    assert blend_dev != picked and "05_eval" in blend_dev
