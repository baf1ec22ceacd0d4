"""Several judges in stage 05: whose posts each judge trained on, the check that no judge scores a
premise it was trained on, and the line that flags a policy which gains only under its training judge.

A policy trained against one judge can learn that judge's blind spots; scored by the same judge it
then looks better without being more convincing (Gao et al. 2022, Singhal et al. 2023). Stage 05
therefore also scores with `--judge_runs`, ideally a *held-out* judge: one trained on posts that
neither the policy (the train split of the eval's pairs run: SFT, GRPO, DPO) nor the scored premises
come from. Stage 03 records the posts (group ids) it trained on, and the digests of their premise
texts, in `train_posts.json`, an artifact of its run (so its digest is checked like the adapter's);
stage 05 reads it back here. A cross-fit's k judges (stage 03's cross_fit_folds), each trained on
all but one fold of the scored split's posts, serve as one held-out judge (CrossFitScorer).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

from common.config import RewardStageConfig, load_run_config, to_dict
from common.data import fold_of, load_split, premise_digest, raw_premise_digest, read_json, write_json
from common.runs import RunError
from common.scorers import register
from common.verdict import families_of, judge_family

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


def _seen(premise: dict, digests: set[str]) -> bool:
    """Whether a judge trained on this premise's text: its normalised digest, or (a judge made before
    premises were normalised) its digest as written."""
    return premise_digest(premise) in digests or raw_premise_digest(premise) in digests


def describe_judges(judge_runs: dict[str, str], training: str | None, scored: list[dict],
                    policy_posts: set[str], trained_configs: dict, trained_against: dict | None = None) -> dict:
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
                "family": judge_family(config), "topic_gate": getattr(config, "topic_gate", 0.0),
                "train_split": config.train_split, "period": _period(config), **audited(path)}
        posts, premises = train_posts(path)
        overlap = sorted({p["group_id"] for p in scored if p["group_id"] in posts or _seen(p, premises)})
        if overlap:
            field = "--reward_run" if name == training else "--judge_runs"
            raise RunError(f"{field} {path}: judge {name} trained on {len(overlap)} of the {len(scored_posts)} "
                           f"premises it would score (e.g. post {overlap[0]}); a judge must not score "
                           f"premises it was trained on")
        # the policies whose manifests name this judge as their reward run (GRPO): for them it is no held-out judge
        info["trained_against_by"] = (trained_against or {}).get(name, [])
        if name == training:
            out[name] = {**info, "role": "training"}
            continue
        shared = len(posts & policy_posts)
        out[name] = {**info, "role": "other" if shared or info["trained_against_by"] else "held_out",
                     "n_train_posts": len(posts),
                     "posts_shared_with_policy": shared, "posts_shared_with_scored_premises": 0}
    return out


def audited(path) -> dict:
    """{"audit": its split, pairs and accuracy with the 95% interval} from a judge run's judge_audit.json (none
    for a run without one): how well the judge picks the real winners, beside what it says of the models."""
    audit = read_json(Path(path) / "judge_audit.json") if (Path(path) / "judge_audit.json").is_file() else {}
    judge = audit.get("judge") if isinstance(audit.get("judge"), dict) else None
    if not judge or "accuracy_ci95" not in judge:
        return {}
    return {"audit": {"split": audit.get("split"), "n_pairs": judge.get("n_pairs"), "accuracy": judge["accuracy"],
                      "accuracy_ci95": judge["accuracy_ci95"]}}


# Fields the k runs of one cross-fit may differ in besides cross_fit_fold: where and under what name
# each run was written and logged. Its pairs run is compared by lineage (a path may be spelled two ways).
CROSS_FIT_FREE = {"cross_fit_fold", "run_name", "runs_dir", "resume", "report_to", "wandb_project", "wandb_group",
                  "pairs_run"}


class CrossFitScorer:
    """The k stage-03 runs of one cross-fit (cross_fit_folds k, one run per fold) as one judge: each
    premise is scored by the fold judge that did not train on its post (by post id and premise text,
    from each run's train_posts.json), so no premise is scored by a judge that saw it, while together
    they trained on the scored split's posts. A model's reply and the base's to one premise are
    scored by the same fold judge, so win rates compare like with like. `score(prompts, replies)` as
    RewardScorer's, for the premises it was built on; `load` loads the k judges, kept together."""

    def __init__(self, runs: list[str], premises: list[dict], prompts: list[list[dict]], pairs_run: str,
                 taken: dict):
        """`prompts`: the premises' prompts as 05 gives them to the judges; `taken`: the other judges' names."""
        configs = [load_run_config(path) for path in runs]
        for path, config in zip(runs, configs):
            if not isinstance(config, RewardStageConfig) or not config.cross_fit_folds:
                raise RunError(f"--crossfit_judge_runs {path}: not a cross-fit's judge (a Reward run with "
                               f"cross_fit_folds >= 2)")
        order = sorted(range(len(runs)), key=lambda i: configs[i].cross_fit_fold)
        by_fold, configs = [runs[i] for i in order], [configs[i] for i in order]
        first, k = configs[0], configs[0].cross_fit_folds
        for path, config in zip(by_fold[1:], configs[1:]):
            ours = to_dict(config)
            differ = [f for f, v in to_dict(first).items() if f not in CROSS_FIT_FREE and ours[f] != v]
            lineage = {read_json(Path(p) / "manifest.json").get("pairs_run") for p in (by_fold[0], path)}
            if differ or len(lineage) > 1:
                what = f"'{differ[0]}'" if differ else "their pairs run"
                raise RunError(f"--crossfit_judge_runs: {by_fold[0]} and {path} differ in {what}: the runs of one "
                               f"cross-fit differ only in cross_fit_fold")
        folds = [c.cross_fit_fold for c in configs]
        twice = sorted({f for f in folds if folds.count(f) > 1})
        missing = sorted(set(range(k)) - set(folds))
        if twice or missing:
            said = [f"fold {', '.join(map(str, missing))} missing"] * bool(missing) + \
                [f"fold {', '.join(map(str, twice))} given twice"] * bool(twice)
            raise RunError(f"--crossfit_judge_runs: a {k}-fold cross-fit takes one run per fold, 0 to {k - 1}: "
                           f"{' and '.join(said)}")
        self.runs, self.name = by_fold, f"{Path(by_fold[0]).name}_crossfit"
        if self.name in taken:
            raise RunError(f"--crossfit_judge_runs: its name {self.name} is another judge's run name")

        # Route every prompt to a fold judge that trained on none of its premises: its own fold's when
        # it can (the post's fold is the one that judge left out), else the first that can.
        trained = [train_posts(p) for p in by_fold]
        allowed, post = {}, {}
        for premise, prompt in zip(premises, prompts):
            key = json.dumps(prompt)  # premises cut to one prompt are one input to a judge
            ok = {j for j, (posts, digests) in enumerate(trained)
                  if premise["group_id"] not in posts and not _seen(premise, digests)}
            allowed[key], post[key] = allowed.get(key, ok) & ok, post.get(key, premise["group_id"])
        seen = sorted(post[key] for key, ok in allowed.items() if not ok)
        if seen:
            raise RunError(f"--crossfit_judge_runs: every judge of the cross-fit {self.name} trained on {len(seen)} "
                           f"of the {len(premises)} premises it would score (e.g. post {seen[0]}): no judge of "
                           f"the set may score them")
        self.route = {key: fold_of(post[key], k) if fold_of(post[key], k) in ok else min(ok)
                      for key, ok in allowed.items()}
        scored = [self.route[json.dumps(p)] for p in prompts]
        counts = {Path(p).name: scored.count(j) for j, p in enumerate(by_fold)}
        posts = set().union(*(p for p, _ in trained))
        shared = len(posts & {r["group_id"] for r in load_split(pairs_run, "train")})
        self.info = {
            "path": [str(Path(p).resolve()) for p in by_fold], "objective": first.judge_objective,
            "backbone": first.judge_backbone, "model": first.judge_model_name_or_path or first.model_name_or_path,
            "family": families_of(configs),
            "train_split": first.train_split, "train_also": first.train_also, "period": _period(first),
            "role": "other" if shared else "held_out", "n_train_posts": len(posts), "posts_shared_with_policy": shared,
            "posts_shared_with_scored_premises": 0, "cross_fit": {"folds": k, "premises_scored": counts},
            "description": f"Cross-fitted: {k} judges of one recipe, each trained on all but one fold of the "
                           f"{first.train_split} posts, and each premise scored by a judge that never trained on "
                           f"its post (" + ", ".join(f"{n}: {c}" for n, c in counts.items()) +
                           f" of the {len(prompts)} premises)."}
        self.scorers = []

    def load(self, batch_size: int = 8, packed: bool = True) -> "CrossFitScorer":
        """A copy with its k judges loaded (freed with the copy: 05 holds one judge at a time)."""
        loaded = copy.copy(self)  # each fold judge built by its backbone (a feature judge too)
        loaded.scorers = [load_judge(p, batch_size=batch_size, packed=packed) for p in self.runs]
        return loaded

    @property
    def spec(self) -> str:
        """Its load_scorer spec, `crossfit:RUN,RUN,...` (the fold judges in fold order)."""
        if any("," in str(p) for p in self.runs):
            raise RunError(f"--crossfit_judge_runs: a run path holds a comma ({next(p for p in self.runs if ',' in str(p))}), "
                           f"which the spec crossfit:RUN,RUN,... cannot hold: move or rename the run")
        return "crossfit:" + ",".join(map(str, self.runs))

    @property
    def scoring(self) -> str:
        return self.scorers[0].scoring

    @property
    def backends(self) -> dict:
        return {"judge_scoring": self.scoring}

    def fingerprints(self) -> dict:
        """Each fold judge's `judge` fingerprint, by run name, as 05's manifest records its judges."""
        return {Path(p).name: read_json(Path(p) / "manifest.json").get("judge") for p in self.runs}

    def score(self, prompts: list[list[dict]], replies: list[str]) -> list[float]:
        """One score per (prompt, reply), in input order, each from its prompt's fold judge."""
        judge = [self.route[json.dumps(p)] for p in prompts]
        scores = [0.0] * len(prompts)
        for j, scorer in enumerate(self.scorers):
            mine = [i for i, fold in enumerate(judge) if fold == j]
            if not mine:
                continue
            for i, score in zip(mine, scorer.score([prompts[i] for i in mine], [replies[i] for i in mine])):
                scores[i] = score
        return scores


@register("crossfit")
def _crossfit(runs: str, premises: list[dict], prompts: list[list[dict]], pairs_run: str, batch_size: int = 8,
              packed: bool = True, **_) -> CrossFitScorer:
    """`crossfit:RUN,RUN,...` (CrossFitScorer.spec): the cross-fit as one Scorer of the premises given, its
    fold judges loaded."""
    return CrossFitScorer(runs.split(","), premises, prompts, pairs_run, taken={}).load(batch_size, packed)


def load_judge(source, batch_size: int = 8, packed: bool = True):
    """A judge's scorer: a Reward run's (its path), or a cross-fit's (a CrossFitScorer, its k judges loaded)."""
    if isinstance(source, CrossFitScorer):
        return source.load(batch_size, packed)
    from common.scorers import load_scorer
    return load_scorer(f"run:{source}", batch_size=batch_size, packed=packed)


def _period(config) -> str:
    """Which kind of held-out the judge's pairs run gives: posts of the same period as the policy's
    (split by post), or, split by period, the later posts (test) apart from the earlier ones."""
    from common.config import ConfigError
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
