"""RAFT (rejection-sampling fine-tuning, Dong et al. 2023): SFT on the judge's best of n sampled
replies of the train premises, the cheap alternative to practice with GRPO.

Two existing stages make it, no new one: stage 05 samples and picks on the train split
(`--split train --best_of_n N --best_of_n_scorer run:REWARD_RUN --fluency_model_name_or_path ...`: the
scorer's favourite among the candidates that pass the fluency gate, common/best_of_n.py; no judge
scores, so nothing is evaluated there), and stage 02 trains on those picks
(`--targets_from EVAL_RUN`): one example a train post, its premise with the picked reply as target.
From a run whose candidates include the greedy reply (`--best_of_n_with_greedy`), `--targets_without_greedy`
picks among the sampled candidates alone, by the same rule from the recorded scores: the plain RAFT and the one
with the greedy reply then train on one generation, and differ by that candidate only.
"""
from __future__ import annotations

from pathlib import Path

from common.best_of_n import choose
from common.config import load_run_config
from common.data import DataError, one_per_group, read_jsonl
from common.runs import RunError


def best_of_n_targets(eval_run: str | Path, train_rows: list[dict], without_greedy: bool = False) -> tuple[list[dict], dict]:
    """The train rows, one a post, with the eval run's best-of-n reply to its premise as the winner (with
    `without_greedy`, the pick among the sampled candidates alone); and what the manifest records (the eval
    run's best_of_n settings, posts kept and without a pick)."""
    eval_run = Path(eval_run)
    config = load_run_config(eval_run)
    if config.split != "train" or not config.best_of_n or config.eval_data or config.replies_from:
        raise DataError(f"--targets_from {eval_run}: not an eval run of best-of-n replies to the train split "
                        f"(split {config.split}, best_of_n {config.best_of_n}); make one with 05_eval.py --split "
                        f"train --best_of_n N")
    with_greedy = getattr(config, "best_of_n_with_greedy", False)  # an Eval run written before the field: False
    if without_greedy and not with_greedy:
        raise DataError(f"--targets_without_greedy: {eval_run}'s candidates do not include the greedy reply "
                        f"(05 --best_of_n_with_greedy true makes such a run)")
    picked = {row["id"]: row["best_of_n"] for _, row in read_jsonl(eval_run / "replies.jsonl")}
    if without_greedy:
        picked = {i: _among_the_samples(p) for i, p in picked.items()}
    rows, missing = [], 0
    for row in one_per_group(train_rows):
        if row["id"] not in picked:
            missing += 1
            continue
        rows.append({**row, "chosen": picked[row["id"]]["reply"]})
    if not rows:
        raise DataError(f"--targets_from {eval_run}: its replies answer none of the train premises")
    none_passed = [not any(p["candidate_passed"]) for p in picked.values() if "candidate_passed" in p]
    greedy = sum(p["reply"] == p["candidates"][0] for p in picked.values()) if with_greedy and not without_greedy \
        else None
    return rows, {"eval_run": str(eval_run.resolve()), "best_of_n": config.best_of_n,
                  "with_greedy": with_greedy and not without_greedy, "n_picks_of_the_greedy_reply": greedy,
                  **({"among_the_samples_of_a_run_with_the_greedy_reply": True} if without_greedy else {}),
                  "scorer": config.best_of_n_scorer or f"run:{config.reward_run}",
                  "fluency_model": config.fluency_model_name_or_path, "n_posts": len(rows),
                  "n_train_posts_without_a_pick": missing, "n_picks_where_no_candidate_passed": sum(none_passed)}


def _among_the_samples(best: dict) -> dict:
    """A best-of-n row of a run with the greedy reply (candidate 0), picked again over the samples, 1..n."""
    j = choose(best["candidate_scores"], best.get("candidate_passed"), best.get("candidate_log_probs"),
               range(1, len(best["candidates"])))
    out = {**best, "reply": best["candidates"][j]}
    if "candidate_passed" in best:
        out["candidate_passed"] = best["candidate_passed"][1:]
    return out


def check_start(run) -> None:
    """RAFT from an SFT adapter (`--sft_run`) continues the policy whose samples it keeps: the SFT run that
    `--targets_from`'s replies were sampled from (by the digest both manifests record)."""
    ours = run.manifest["inputs"]["sft_run"]
    theirs = (run.inputs["targets_from"].get("inputs") or {}).get("sft_run") or {}
    if theirs.get("sha256") != ours["sha256"]:
        sampler = theirs.get("run_name") or theirs.get("path") or "no SFT run (the base)"
        raise RunError(f"--sft_run {ours['path']}: --targets_from's replies were sampled from {sampler}, not from "
                       f"it; RAFT continues the policy whose samples it trains on")
