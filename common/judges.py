"""Several judges in stage 05: whose posts each judge trained on, the check that no judge scores a
premise it was trained on, and the line that flags a policy which gains only under its training judge.

A policy trained against one judge can learn that judge's blind spots; scored by the same judge it
then looks better without being more convincing (Gao et al. 2022, Singhal et al. 2023). Stage 05
therefore also scores with `--judge_runs`, ideally a *held-out* judge: one trained on posts that
neither the policy (the train split of the eval's pairs run: SFT, GRPO, DPO) nor the scored premises
come from. Stage 03 records the posts (group ids) it trained on, and the digests of their premise
texts, in `train_posts.json`, an artifact of its run (so its digest is checked like the adapter's);
stage 05 reads it back here.
"""
from __future__ import annotations

from pathlib import Path

from common.data import premise_digest, read_json, write_json
from common.runs import RunError

TRAIN_POSTS = "train_posts.json"


def write_train_posts(run_dir: Path, split: str, rows: list[dict], train_also: list[str] = (),
                      cross_fit: dict | None = None) -> None:
    """Stage 03: the posts (premises' group ids) behind the pairs the judge trains on, all of them
    (train_also's too), and the digests of their premise texts (the same post under another id is the
    same premise); a cross-fit's judge also records its folds and the fold it left out."""
    write_json(Path(run_dir) / TRAIN_POSTS, {"split": split, "train_also": list(train_also), "n_pairs": len(rows),
                                             **({"cross_fit": cross_fit} if cross_fit else {}),
                                             "posts": sorted({r["group_id"] for r in rows}),
                                             "premises": sorted({premise_digest(r) for r in rows})})


def train_posts(reward_run: str | Path) -> tuple[set[str], set[str]]:
    """(post ids, premise digests) a judge trained on."""
    path = Path(reward_run) / TRAIN_POSTS
    saved = read_json(path) if path.is_file() else {}
    if "premises" not in saved:
        raise RunError(f"judge {Path(reward_run).name} records no premises in {TRAIN_POSTS} (made before stage 03 "
                       f"kept them): its overlap with the scored premises cannot be checked; re-run stage 03")
    return set(saved["posts"]), set(saved["premises"])


def describe_judges(judge_runs: dict[str, str], training: str | None, scored: list[dict],
                    policy_posts: set[str], trained_configs: dict) -> dict:
    """{run name: what the report says of the judge}, after the overlap check: a judge (the training
    one, `training`, --reward_run, as well as each of `--judge_runs`) that trained on a scored premise,
    by post id or by premise text, is refused, naming it and the count. A judge is `held_out` when it
    shares no post with the policy's train split either; else `other` (another judge on the policy's
    posts)."""
    scored_posts = {p["group_id"] for p in scored}
    out = {}
    for name, path in judge_runs.items():
        config = trained_configs[name]
        info = {"path": str(Path(path).resolve()), "objective": config.judge_objective,
                "backbone": config.judge_backbone,
                "model": config.judge_model_name_or_path or config.model_name_or_path,
                "train_split": config.train_split, "period": _period(config)}
        posts, premises = train_posts(path)
        overlap = sorted({p["group_id"] for p in scored if p["group_id"] in posts or premise_digest(p) in premises})
        if overlap:
            field = "--reward_run" if name == training else "--judge_runs"
            raise RunError(f"{field} {path}: judge {name} trained on {len(overlap)} of the {len(scored_posts)} "
                           f"premises it would score (e.g. post {overlap[0]}); a judge must not score "
                           f"premises it was trained on")
        if name == training:
            out[name] = {**info, "role": "training"}
            continue
        shared = len(posts & policy_posts)
        out[name] = {**info, "role": "other" if shared else "held_out", "n_train_posts": len(posts),
                     "posts_shared_with_policy": shared, "posts_shared_with_scored_premises": 0}
    return out


def _period(config) -> str:
    """Which kind of held-out the judge's pairs run gives: posts of the same period as the policy's
    (split by post), or, split by period, the later posts (test) apart from the earlier ones."""
    from common.config import ConfigError, load_run_config
    from common.data import DataError
    try:
        split_by = load_run_config(config.pairs_run).split_by
    except (ConfigError, DataError, OSError):
        return "its pairs run cannot be read: period unknown"
    if split_by != "period":
        return "in-period (its pairs run is split by post: every split is of one period)"
    if config.train_split == "test":
        return "trained on the later period's posts (its pairs run is split by period)"
    return f"trained in-period on {config.train_split} (its pairs run is split by period: test is the later posts)"


def gain_lines(results: dict, judges: dict) -> list[str]:
    """For every model but the base: does a win over the base under the training judge (interval
    above 0.5) hold under each held-out judge? One plain line per model and held-out judge."""
    training = next((n for n, j in judges.items() if j["role"] == "training"), None)
    held_out = [n for n, j in judges.items() if j["role"] == "held_out"]
    lines = []
    for model, r in results.items():
        if model == "base" or training is None:
            continue
        own = r["by_judge"][training]
        if own["win_rate_vs_base_ci95"][0] <= 0.5:
            continue  # no gain under the training judge: nothing to confirm
        for name in held_out:
            other = r["by_judge"][name]
            said = (f"{model} beats the base under its training judge {training} (win rate "
                    f"{_ci(own, 'win_rate_vs_base')})")
            if other["win_rate_vs_base_ci95"][0] > 0.5:
                lines.append(f"{said}, and the gain holds under the held-out judge {name} "
                             f"({_ci(other, 'win_rate_vs_base')}).")
            else:
                lines.append(f"**{said} but not under the held-out judge {name} ({_ci(other, 'win_rate_vs_base')})**: "
                             f"the gain may be the training judge's blind spots, not a more convincing writer.")
        if own["lc_win_rate_vs_base_ci95"][0] <= 0.5:
            lines.append(f"**{model}'s win over the base under {training} ({_ci(own, 'win_rate_vs_base')}) is not "
                         f"there at equal length (length-controlled {_ci(own, 'lc_win_rate_vs_base')})**: longer "
                         f"replies, not better ones, may explain it.")
    return lines


def _ci(r: dict, key: str) -> str:
    low, high = r[f"{key}_ci95"]
    return f"{r[key]:.2f} [{low:.2f}, {high:.2f}]"
