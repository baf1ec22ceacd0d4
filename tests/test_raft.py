"""RAFT (common/raft.py): stage 05 picks the best of n sampled replies to the train premises, gated on
fluency, and stage 02 trains on the picks, through the real command lines on the tiny recipe."""
from __future__ import annotations

import json

import pytest
from conftest import error_line, run_dir_of, run_stage

from common.raft import best_of_n_targets


@pytest.mark.stage
def test_sft_trains_on_the_gated_best_of_n_picks_of_the_train_premises(pairs_run, tiny_model, tmp_path):
    common = ["--runs_dir", tmp_path]
    picks = run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                                 "--split", "train", "--best_of_n", "3", "--best_of_n_scorer",
                                 "tests.test_scorers:words", "--fluency_model_name_or_path", tiny_model,
                                 "--best_of_n_fluency_margin", "0.3", *common))
    replies = [json.loads(line) for line in (picks / "replies.jsonl").read_text().splitlines()]
    for row in replies:
        best = row["best_of_n"]
        ok = [c for c, passed in zip(best["candidates"], best["candidate_passed"]) if passed]
        # the wordiest candidate that passed the gate (the first on a tie); where none did, the most fluent one
        lps = best["candidate_log_probs"]
        assert best["reply"] == (max(ok, key=lambda c: len(c.split())) if ok else
                                 best["candidates"][lps.index(max(lps))])
        bar = row["base"]["fluency_log_prob"] - 0.3
        assert best["candidate_passed"] == [lp >= bar for lp in lps]
    manifest = json.loads((picks / "manifest.json").read_text())
    assert manifest["best_of_n"]["scorer"] == "tests.test_scorers:words" and "0.3" in manifest["best_of_n"]["fluency_gate"]

    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run",
                               pairs_run, "--targets_from", picks, *common))
    recorded = json.loads((sft / "manifest.json").read_text())
    assert "targets_from" in recorded["inputs"] and recorded["targets_from"]["n_posts"] == len(replies)
    assert json.loads((sft / "metrics.json").read_text())["n_train_examples"] == len(replies)
    # a run that is not an Eval run is no source of training targets: one error line
    proc = run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs_run,
                     "--targets_from", sft, *common, check=False)
    assert "targets_from" in error_line(proc)


@pytest.mark.stage
def test_best_of_n_with_the_greedy_reply_always_has_a_fluent_candidate(pairs_run, tiny_model, tmp_path):
    common = ["--runs_dir", tmp_path, "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run]
    picks = run_dir_of(run_stage("05_eval.py", *common, "--split", "train", "--best_of_n", "2", "--best_of_n_scorer",
                                 "tests.test_scorers:words", "--fluency_model_name_or_path", tiny_model,
                                 "--best_of_n_fluency_margin", "0.0", "--best_of_n_with_greedy", "true",
                                 "--max_premises", "4"))
    for _, row in [(None, json.loads(line)) for line in (picks / "replies.jsonl").read_text().splitlines()]:
        best = row["best_of_n"]
        assert len(best["candidates"]) == 3 and best["candidates"][0] == row["base"]["reply"]
        assert best["candidate_cut"][0] == row["base"]["cut"]  # the greedy candidate's flag is its reply's
        assert best["candidate_passed"][0] is True  # the bar is its own log-prob: a pick never falls back
        ok = [c for c, passed in zip(best["candidates"], best["candidate_passed"]) if passed]
        assert best["reply"] == max(ok, key=lambda c: len(c.split()))
    assert json.loads((picks / "manifest.json").read_text())["best_of_n"]["with_greedy"] is True
    assert "and its greedy reply" in (picks / "report.md").read_text()
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run",
                               pairs_run, "--targets_from", picks, "--runs_dir", tmp_path))
    targets = json.loads((sft / "manifest.json").read_text())["targets_from"]
    rows = [json.loads(line)["best_of_n"] for line in (picks / "replies.jsonl").read_text().splitlines()]
    assert targets["with_greedy"] is True
    assert targets["n_picks_of_the_greedy_reply"] == sum(r["reply"] == r["candidates"][0] for r in rows)
    # the plain RAFT from the same generation: the same rule over the samples alone (candidates 1..n)
    plain = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run",
                                 pairs_run, "--targets_from", picks, "--targets_without_greedy", "true",
                                 "--runs_dir", tmp_path))
    recorded = json.loads((plain / "manifest.json").read_text())["targets_from"]
    assert recorded["with_greedy"] is False and recorded["among_the_samples_of_a_run_with_the_greedy_reply"] is True
    assert recorded["n_posts"] == targets["n_posts"] and recorded["n_picks_of_the_greedy_reply"] is None
    from common.data import load_split
    chosen, _ = best_of_n_targets(picks, load_split(pairs_run, "train"), without_greedy=True)
    by_id = {json.loads(line)["id"]: json.loads(line)["best_of_n"] for line in (picks / "replies.jsonl").read_text().splitlines()}
    for row in chosen:
        best = by_id[row["id"]]
        samples = [c for c, ok in zip(best["candidates"][1:], best["candidate_passed"][1:]) if ok]
        lps = best["candidate_log_probs"][1:]
        assert row["chosen"] == (max(samples, key=lambda c: len(c.split())) if samples
                                 else best["candidates"][1 + lps.index(max(lps))])
    # from a run without the greedy reply, or without --targets_from: one error line
    for extra in (["--targets_from", plain_picks(pairs_run, tiny_model, tmp_path)], []):
        proc = run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--pairs_run", pairs_run,
                         "--targets_without_greedy", "true", *extra, "--runs_dir", tmp_path, check=False)
        assert "targets_without_greedy" in error_line(proc)
    # without best_of_n (or without a model whose greedy reply it is): one error line
    proc = run_stage("05_eval.py", *common, "--best_of_n_with_greedy", "true", check=False)
    assert "best_of_n_with_greedy" in error_line(proc)


@pytest.mark.stage
def test_raft_from_the_sft_adapter_continues_the_policy_that_sampled_its_targets(pairs_run, tiny_model, tmp_path):
    """Rejection-sampling fine-tuning trains on the policy whose samples it keeps (`--sft_run`), not on a fresh
    adapter on the base: its adapter starts as SFT's; picks sampled from another model are refused."""
    from safetensors.torch import load_file
    common = ["--runs_dir", tmp_path, "--pairs_run", pairs_run]
    sft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", *common))
    best_of = ["--config", "configs/tiny/05_eval.yaml", "--split", "train", "--best_of_n", "2", "--best_of_n_scorer",
               "tests.test_scorers:words", "--fluency_model_name_or_path", tiny_model, "--max_premises", "4", *common]
    picks = run_dir_of(run_stage("05_eval.py", *best_of, "--sft_run", sft))
    raft = run_dir_of(run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--targets_from", picks,
                                "--sft_run", sft, "--max_steps", "1", "--learning_rate", "1e-6", *common))
    manifest = json.loads((raft / "manifest.json").read_text())
    assert manifest["started_from"] == "sft" and manifest["inputs"]["sft_run"]["run_name"] == sft.name
    start, kept = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (sft, raft))
    assert start.keys() == kept.keys()
    lora_b = [k for k in start if "lora_B" in k]  # zero in a fresh adapter; SFT's training moved it
    assert lora_b and all(start[k].abs().max() > 0 for k in lora_b)
    for k in lora_b:  # one step at lr 1e-6: still SFT's B, where a fresh adapter's would be about 0
        assert (kept[k].float() - start[k].float()).abs().max() < 0.05 * start[k].float().abs().max(), k
    # picks sampled from the base are no RAFT start for SFT's adapter; --sft_run alone is no RAFT: one error line each
    from_base = run_dir_of(run_stage("05_eval.py", *best_of))
    for extra in (["--targets_from", from_base], []):
        proc = run_stage("02_train_sft.py", "--config", "configs/tiny/02_train_sft.yaml", "--sft_run", sft, *extra,
                         *common, check=False)
        assert "--sft_run" in error_line(proc), proc.stderr[-2000:]


def plain_picks(pairs_run, tiny_model, tmp_path):
    """A best-of-2 run of the train split without the greedy reply."""
    return run_dir_of(run_stage("05_eval.py", "--config", "configs/tiny/05_eval.yaml", "--pairs_run", pairs_run,
                                "--split", "train", "--best_of_n", "2", "--best_of_n_scorer", "tests.test_scorers:words",
                                "--max_premises", "2", "--run_name", "Plain_Picks", "--runs_dir", tmp_path))


def test_choose_keeps_the_best_passing_candidate_among_those_asked():
    from common.best_of_n import choose
    scores, passed, lps = [5.0, 1.0, 3.0, 2.0], [True, False, True, True], [-1.0, -0.5, -2.0, -3.0]
    assert choose(scores, passed, lps) == 0 and choose(scores, passed, lps, range(1, 4)) == 2
    assert choose(scores, None, lps, range(1, 4)) == 2  # no gate: the best scored
    assert choose(scores, [True, False, False, False], lps, range(1, 4)) == 1  # none passed: the most fluent
    assert choose(scores, [True, False, False, False], [-1.0, float("nan"), -2.0, -3.0], range(1, 4)) == 2
