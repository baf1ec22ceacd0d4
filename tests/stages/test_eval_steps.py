"""Stage 05 in named steps (generate_all, score_all, task.evaluate, write_outputs), on the tiny CMV recipe
with a judge, best-of-n and a fluency model: the same inputs and seeds give the same eval.json,
replies.jsonl and report.md; eval.json's figures are those its replies.jsonl's scores give; and every
stage script keeps its steps short (main of 05 at most 60 lines, no stage function over 80)."""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest
from conftest import REPO, run_dir_of, run_stage

from common.data import load_split
from common.metrics import judge_metrics, text_metrics
from common.verdict import fluency_figures

STAGES = sorted(p.name for p in REPO.glob("0[1-5]_*.py"))
TIMING = ("seconds", "new_tokens_per_s")  # wall time: the one thing that may differ between two runs


def _functions(script: str) -> dict[str, int]:
    """Every function of a stage script (nested ones too) -> its length in lines, decorators and docstring included."""
    tree = ast.parse((REPO / script).read_text())
    return {node.name: node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_stage_scripts_hold_short_named_steps():
    assert len(STAGES) >= 6, STAGES
    long = {(script, name): n for script in STAGES for name, n in _functions(script).items() if n > 80}
    assert not long, f"stage functions over 80 lines: {long}"
    assert _functions("05_eval.py")["main"] <= 60
    steps = set(_functions("05_eval.py"))
    assert {"generate_all", "score_all", "write_outputs"} <= steps
    assert "task.evaluate(" in ast.get_source_segment((REPO / "05_eval.py").read_text(), next(
        n for n in ast.walk(ast.parse((REPO / "05_eval.py").read_text()))
        if isinstance(n, ast.FunctionDef) and n.name == "main"))


def _strip(value):
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


@pytest.fixture(scope="module")
def two_evals(tiny_model, pairs_run, tmp_path_factory):
    runs = tmp_path_factory.mktemp("eval_steps")
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run",
                               pairs_run, "--max_steps", 1, "--runs_dir", runs))
    reward = run_dir_of(run_stage("03_train_reward.py", "--config", "configs/tiny/03_train_reward.yaml",
                                  "--pairs_run", pairs_run, "--max_steps", 1, "--runs_dir", runs))
    args = ["--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run, "--reward_run", reward,
            "--sft_run", sft, "--best_of_n", 2, "--fluency_model_name_or_path", tiny_model, "--max_premises", 3,
            "--max_new_tokens", 8, "--temperature", 0.7, "--runs_dir", runs]
    return [run_dir_of(run_stage("05_eval.py", *args, "--run_name", f"Eval{i}")) for i in (1, 2)], pairs_run, reward


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.stage
def test_the_same_inputs_and_seeds_give_the_same_results(two_evals):
    (first, second), _, _ = two_evals
    assert _strip(json.loads((first / "eval.json").read_text())) == _strip(json.loads((second / "eval.json").read_text()))
    assert _lines(first / "replies.jsonl") == _lines(second / "replies.jsonl")
    # the report, but for wall times and its own run name
    shown = [re.sub(r"\d+(\.\d+)?( s|/s)", "T", (run / "report.md").read_text()).replace(run.name, "RUN")
             for run in (first, second)]
    assert shown[0] == shown[1]


@pytest.mark.stage
def test_eval_json_says_what_the_replies_and_their_scores_give(two_evals):
    (run, _), pairs, reward = two_evals
    results, rows = json.loads((run / "eval.json").read_text()), _lines(run / "replies.jsonl")
    models = ["base", "sft", "best_of_n"]
    assert [m for m in results if m != "judges"] == models
    test = {r["id"]: r for r in load_split(pairs, "test")}
    judge = reward.name
    words = {m: [len(r[m]["reply"].split()) for r in rows] for m in models}
    scores = {m: [r[m]["by_judge"][judge] for r in rows] for m in models}
    figures = fluency_figures({m: [math.nan if r[m]["fluency_log_prob"] is None else r[m]["fluency_log_prob"]
                                   for r in rows] for m in models})
    for m in models:
        assert [r[m]["reward"] for r in rows] == scores[m]
        want = {**text_metrics([r[m]["reply"] for r in rows], [[test[r["id"]]["chosen"]] for r in rows]),
                **judge_metrics(scores[m], scores["base"], words[m], words["base"], 42)}
        if m == "best_of_n":
            want.update(judge_metrics(scores[m], scores["sft"], words[m], words["sft"], 42, against="sft"))
        want.update(figures[m])
        for key, value in want.items():
            assert results[m][key] == pytest.approx(value, nan_ok=True), (m, key)
        assert results[m]["by_judge"][judge]["win_rate_vs_base"] == results[m]["win_rate_vs_base"]
        assert results[m]["cut_share"] == pytest.approx(sum(r[m]["cut"] for r in rows) / len(rows)), m
    for r in rows:  # best-of-n keeps its scorer's favourite among the candidates that passed the gate
        best = r["best_of_n"]
        ok = [j for j, passed in enumerate(best["candidate_passed"]) if passed]
        pick = max(ok, key=best["candidate_scores"].__getitem__) if ok else \
            max(range(len(best["candidates"])), key=lambda j: -math.inf if best["candidate_log_probs"][j] is None
            else best["candidate_log_probs"][j])
        assert best["reply"] == best["candidates"][pick] and best["reward"] == pytest.approx(best["candidate_scores"][pick])
        assert best["cut"] == best["candidate_cut"][pick]
