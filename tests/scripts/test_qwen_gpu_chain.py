"""scripts/qwen_gpu_chain.sh, the GPU machine's persuasion chain, with the tiny recipes on the CPU: it runs
scripts/persuasion_real_weights.sh (tested on its own in test_persuasion_real_weights.py), then SmolLM2's base
replies and the writers' fluency, and writes qwen_gpu_chain.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.stage  # it runs stage scripts (tests/README.md)


def test_the_gpu_chain_runs_on_the_tiny_recipes_and_writes_its_record(tiny_model, tmp_path):
    candidates = tmp_path / "candidates.txt"
    # one judge family only: no held-out judge of another family, which the chain must survive
    candidates.write_text("features --config configs/tiny/03_train_reward_features.yaml\n")
    env = {**os.environ, "PY": sys.executable, "RUNS_DIR": str(tmp_path), "RECIPE": "configs/tiny",
           "PAIRS_CONFIG": "configs/smol/01_build_pairs.yaml", "SMOL_RECIPE": "configs/tiny", "MODELS": "",
           "FLUENCY_MODEL": str(tiny_model), "BUILTIN": "0", "CANDIDATES_FILE": str(candidates), "ENSEMBLE_SIZES": "",
           "TWO_JUDGE_ENSEMBLE": "0", "FRAMINGS": "", "HARD_NEGATIVES": "0", "RAFT_GREEDY": "0", "GRPO_ONLY": "lr1e-4",
           "MAX_PREMISES": "4", "BEST_OF_N": "2"}
    proc = subprocess.run(["bash", "scripts/qwen_gpu_chain.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    logs = tmp_path / "logs"
    assert proc.returncode == 0, proc.stderr[-3000:] + (logs / "chain.err").read_text()[-3000:]
    record = json.loads((tmp_path / "qwen_gpu_chain.json").read_text())
    assert record["chain_rc"] == 0 and record["failed_stages"] == "" and record["max_jobs"] >= 1
    evalrun = record["eval_run"]
    assert os.path.exists(f"{evalrun}/DONE")
    models = json.loads(open(f"{evalrun}/eval.json").read())
    assert {"base", "sft", "grpo", "dpo", "orpo", "raft", "best_of_n"} <= set(models)
    # every stage of the chain in its timeline, each with its seconds
    stages = [s["stage"] for s in record["stages"]["chain"]]
    assert {"sft", "grpo_lr1e-4", "dpo", "orpo", "raft_targets", "raft"} <= set(stages), stages
    assert [s["stage"] for s in record["stages"]["judges"]] == ["features"]
    # the two writers' base replies: the recipe's and SmolLM2's (its 05 run), each with its speed and fluency
    assert set(record["generation_speed"]) == {"qwen", "smol"} and "base" in record["generation_speed"]["smol"]
    for writer in ("qwen", "smol"):
        assert record["base_reply_fluency_under_gemma"][writer]["perplexity"] > 1
