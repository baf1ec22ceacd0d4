"""scripts/persuasion_real_weights.sh in its CPU mode (the tiny recipe): every stage runs, and the
comparison table (per model and judge, vs base and vs SFT, with intervals) is written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_the_persuasion_script_runs_every_stage_and_writes_the_comparison(tiny_model, tmp_path):
    env = {**os.environ, "RECIPE": "configs/tiny", "PAIRS_CONFIG": "configs/tiny/01_build_pairs.yaml",
           "RUNS_DIR": str(tmp_path), "SUMMARY_DIR": str(tmp_path / "summary"),
           "PY": sys.executable}  # scripts/demo_lib.sh's default is .venv's
    proc = subprocess.run(["bash", "scripts/persuasion_real_weights.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary" / "persuasion_real_weights.json").read_text())
    assert list(summary["models"]) == ["base", "sft", "grpo", "dpo", "orpo"]
    roles = {j["role"] for j in summary["judges"].values()}
    assert roles == {"training", "held_out"}
    held_out = next(j for j in summary["judges"].values() if j["role"] == "held_out")
    assert held_out["train_split"] == "dev" and held_out["n_pairs"] > 0
    assert {"accuracy", "accuracy_ci95", "length_only", "bag_of_words"} <= set(held_out)
    for name, model in summary["models"].items():
        assert model["n"] == summary["n_premises"] and model["distinct_2"] is not None
        for judge in summary["judges"]:
            scored = model["by_judge"][judge]
            low, high = scored["win_rate_vs_base_ci95"]
            assert low <= scored["win_rate_vs_base"] <= high and "lc_win_rate_vs_base_ci95" in scored
            assert ("win_rate_vs_sft" in scored) == (name not in ("base", "sft")), name
    assert summary["grpo_per_step"] and {"reward_mean", "reply_words_mean", "distinct_2", "premise_overlap"} <= \
        set(summary["grpo_per_step"][0])
    report = proc.stdout.strip().splitlines()[-1].split(" ", 1)[1]
    text = open(report).read()
    assert "win rate vs SFT" in text and "grpo_watch.png" in text
