"""scripts/review_real_weights.sh's switches, with a stand-in interpreter that records each call (the whole chain on
the tiny model has its own test: tests/test_readout.py)."""
from __future__ import annotations

import os
import subprocess

from conftest import REPO

FAKE_PY = r'''#!/usr/bin/env bash
# A stand-in interpreter: every stage "finishes" with a run directory; the helper script prints what the chain reads.
script=$1; shift
echo "$script $*" >> "$CALLS"
command=${1:-}
runs=$RUNS_DIR
while (( $# )); do case $1 in --runs_dir) runs=$2; shift 2 ;; *) shift ;; esac; done
case $script in
  scripts/review_real_weights.py) [[ $command == pick ]] && printf '%s\n' "--temperature 0" "--reading first_window"
    exit 0 ;;
esac
name=$(basename "$script" .py)_$RANDOM$RANDOM
mkdir -p "$runs/$name" && echo "run_dir: $runs/$name"
'''


def _chain(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    proc = subprocess.run(["bash", "scripts/review_real_weights.sh"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PY": str(fake), "RUNS_DIR": str(tmp_path / "runs"), "CALLS": str(calls),
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
