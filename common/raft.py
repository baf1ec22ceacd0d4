"""RAFT (rejection-sampling fine-tuning, Dong et al. 2023): SFT on the judge's best of n sampled
replies of the train premises, the cheap alternative to practice with GRPO.

Two existing stages make it, no new one: stage 05 samples and picks on the train split
(`--split train --best_of_n N --best_of_n_scorer run:REWARD_RUN --fluency_model_name_or_path ...`: the
scorer's favourite among the candidates that pass the fluency gate, common/best_of_n.py; no judge
scores, so nothing is evaluated there), and stage 02 trains on those picks
(`--targets_from EVAL_RUN`): one example a train post, its premise with the picked reply as target.
"""
from __future__ import annotations

from pathlib import Path

from common.config import load_run_config
from common.data import DataError, one_per_group, read_jsonl


def best_of_n_targets(eval_run: str | Path, train_rows: list[dict]) -> tuple[list[dict], dict]:
    """The train rows, one a post, with the eval run's best-of-n reply to its premise as the winner;
    and what the manifest records (the eval run's best_of_n settings, posts kept and without a pick)."""
    eval_run = Path(eval_run)
    config = load_run_config(eval_run)
    if config.split != "train" or not config.best_of_n or config.eval_data or config.replies_from:
        raise DataError(f"--targets_from {eval_run}: not an eval run of best-of-n replies to the train split "
                        f"(split {config.split}, best_of_n {config.best_of_n}); make one with 05_eval.py --split "
                        f"train --best_of_n N")
    picked = {row["id"]: row["best_of_n"] for _, row in read_jsonl(eval_run / "replies.jsonl")}
    rows, missing = [], 0
    for row in one_per_group(train_rows):
        if row["id"] not in picked:
            missing += 1
            continue
        rows.append({**row, "chosen": picked[row["id"]]["reply"]})
    if not rows:
        raise DataError(f"--targets_from {eval_run}: its replies answer none of the train premises")
    none_passed = [not any(p["candidate_passed"]) for p in picked.values() if "candidate_passed" in p]
    with_greedy = getattr(config, "best_of_n_with_greedy", False)  # an Eval run written before the field: False
    greedy = sum(p["reply"] == p["candidates"][0] for p in picked.values()) if with_greedy else None
    return rows, {"eval_run": str(eval_run.resolve()), "best_of_n": config.best_of_n,
                  "with_greedy": with_greedy, "n_picks_of_the_greedy_reply": greedy,
                  "scorer": config.best_of_n_scorer or f"run:{config.reward_run}",
                  "fluency_model": config.fluency_model_name_or_path, "n_posts": len(rows),
                  "n_train_posts_without_a_pick": missing, "n_picks_where_no_candidate_passed": sum(none_passed)}
