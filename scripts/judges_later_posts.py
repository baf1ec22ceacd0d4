"""The steps of scripts/judges_later_posts.sh that are not stages.

    python scripts/judges_later_posts.py best2 [--k K] NAME=REWARD_RUN ...  # the 2 (K) single judges best on dev_later
    python scripts/judges_later_posts.py best NAME=REWARD_RUN ...      # prints `best: NAME RUN`
    python scripts/judges_later_posts.py families --not NAME NAME=REWARD_RUN ...  # `NAME RUN FAMILY` a line
    python scripts/judges_later_posts.py summary OUT_DIR NAME=REWARD_RUN ... --ensemble ENSEMBLE_JSON
    python scripts/judges_later_posts.py add_lever OUT_DIR LEVER NAME=REWARD_RUN AGAINST=REWARD_RUN  # a later row

Every choice is made on dev_later (later posts that are not the test), never on test. `summary` writes
OUT_DIR/judges_later_posts.json: for each judge (and the ensemble of scripts/judge_ensemble.py), its
run, its accuracy with a 95% interval on dev_later, dev (in-period) and test, the length-only and
bag-of-words baselines on each (from its judge_audit.json: fitted on the same train pairs), `default:
true` on the single judge best on dev_later (the one the recipes use: stages 04 and 05 take one judge
run), `baselines` (both, per split), and whether the default meets the targets on test. A single judge
is any but a stage-03 ensemble (judge_backbone ensemble), which `best` and `best2` never pick.

`best`, the judge a policy trains against, is the best on dev_later among the judges that pass the
gibberish audit on dev_later (every corruption kind's share >= its target; common/corruptions.py): a
judge a policy can fool with salad is the reward hack waiting to happen. When none passes, the one whose
weakest corruption kind holds best among the judges level with the best on dev_later (the paired 95%
interval of their accuracy difference reaches 0), with a warning. `families` lists, for each family but NAME's, its best single judge on
dev_later, best first: the held-out judges of other families are trained in those recipes.

`levers` (also OUT_DIR/judges_later_posts.md) is one table on dev_later of what each lever added, from
the judges' per-pair dev_later scores (<run>/dev_later_scores.jsonl), with paired bootstrap intervals:
each single judge without a `+` in its name (a family or recipe, the feature judge among them) against
the reference (`minilm_pairwise`, else the first judge); `NAME+LEVER` (corruptions, hard negatives, ...)
against NAME; a stage-03 ensemble against the best of its members. A topic gate is read on the same trained
judge without it (stage 03 writes both scores), since two trainings of one recipe differ by themselves (on a
GPU by 10 points of dev_later); its plain twin NAME, trained apart, gets a row against that same ungated judge:
what a second training alone moves. Test is shown, never chosen on.
`add_lever` adds one judge trained after the summary (the judge's second round on a policy's replies,
scripts/persuasion_real_weights.sh) and its row against the judge it hardens; the training judge stays
the one the summary chose.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_json, write_json  # noqa: E402
from common.metrics import bootstrap_ci, wins  # noqa: E402

SPLITS = {"dev_later": "later posts (where judges are chosen)", "dev": "in-period", "test": "later posts"}


def _named(items: list[str]) -> dict[str, Path]:
    return {name: Path(run) for name, _, run in (item.partition("=") for item in items)}


def judge_row(run: Path) -> dict:
    """A judge's accuracy and both shortcut baselines on dev and test, from its judge_audit.json."""
    audit = read_json(run / "judge_audit.json")
    metrics = read_json(run / "metrics.json")
    row = {"run": run.name, "pairs_run": Path(read_json(run / "manifest.json")["pairs_run"]).name,
           "objective": metrics.get("judge_objective"), "early_stopping": metrics.get("early_stopping"),
           "family": family(run), "gibberish_dev_later": gibberish_on_dev_later(run)}
    for split, period in SPLITS.items():
        judged = audit["judge"] if audit["split"] == split else audit["other_splits"][split]
        row[split] = {"period": audit["periods"].get(split, period), "n_pairs": judged["n_pairs"],
                      "accuracy": judged["accuracy"], "accuracy_ci95": judged["accuracy_ci95"],
                      "length_only": audit["baselines"]["length_only"][f"{split}_accuracy"],
                      "bag_of_words": audit["baselines"]["bag_of_words"][f"{split}_accuracy"]}
    return row


def gibberish_on_dev_later(run: Path) -> float | None:
    """The weakest corruption kind's share of verdicts for the real reply, on dev_later only (never test)."""
    kinds = (read_json(run / "judge_audit.json").get("corruption") or {}).get("kinds") or {}
    shares = [k["by_split"].get("dev_later", {}).get("share") for k in kinds.values()]
    return min(shares) if shares and None not in shares else None


def family(run: Path) -> str:
    from common.config import load_run_config
    from common.verdict import judge_family
    return judge_family(load_run_config(run))


def meets_target(row: dict) -> bool:
    """On later posts: the interval above chance and above bag-of-words' point estimate."""
    test = row["test"]
    return test["accuracy_ci95"][0] > max(0.5, test["bag_of_words"])


def ranked(items: list[str]) -> list[tuple[str, Path]]:
    runs = _named(items)
    return sorted(runs.items(), key=lambda item: -judge_row(item[1])["dev_later"]["accuracy"])


def is_ensemble(run: Path) -> bool:
    return (read_json(run / "manifest.json").get("judge") or {}).get("backbone") == "ensemble"


def best2(items: list[str], k: int = 2) -> list[Path]:
    return [run for _, run in ranked(items) if not is_ensemble(run)][:k]


def level_with(run: Path, top: Path) -> bool:
    """Is `run`'s dev_later accuracy not shown below `top`'s: the paired 95% interval of the difference on the
    pairs both judged reaches 0? Without per-pair scores nothing is shown either way: not level."""
    a, b = correct_on(run), correct_on(top)
    ids = sorted(set(a) & set(b))
    return bool(ids) and bootstrap_ci(np.array([a[i] - b[i] for i in ids]))[1] >= 0


def best(items: list[str]) -> tuple[str, Path]:
    """The training judge (module docstring): the best on dev_later among those that pass the gibberish audit;
    when none passes, the one that resists gibberish best (its weakest kind's share on dev_later) among those
    level with the best on dev_later, so that a policy practises against the hardest judge to fool that is not
    shown to rank worse."""
    singles = [(n, r) for n, r in ranked(items) if not is_ensemble(r)]
    from common.corruptions import TARGET
    passing = [(n, r) for n, r in singles if (gibberish_on_dev_later(r) or 0.0) >= TARGET]
    if passing:
        return passing[0]
    top = singles[0]
    level = [top] + [(n, r) for n, r in singles[1:] if level_with(r, top[1])]
    taken = max(level, key=lambda item: gibberish_on_dev_later(item[1]) or 0.0)  # ties: the better on dev_later
    shares = {n: gibberish_on_dev_later(r) for n, r in level}
    print(f"warning: no judge passes the gibberish audit on dev_later (every kind >= {TARGET:.0%}); among the judges "
          f"level with the best on dev_later ({top[0]}: " + ", ".join(
              f"{n} {'n/a' if s is None else f'{s:.2f}'}" for n, s in shares.items()) +
          f", the weakest kind's share), {taken[0]} resists it best and is taken", file=sys.stderr)
    return taken


def families(items: list[str], not_of: str) -> list[tuple[str, Path, str]]:
    """The best single judge on dev_later of each family but `not_of`'s, best first."""
    runs = _named(items)
    excluded, out = family(runs[not_of]), {}
    for name, run in ranked(items):
        fam = family(run)
        if not is_ensemble(run) and fam != excluded and fam not in out:
            out[fam] = (name, run, fam)
    return list(out.values())


def correct_on(run: Path, split: str = "dev_later", ungated: bool = False) -> dict[str, float]:
    """{pair id: 1 right, 0.5 tie, 0 wrong} from the run's per-pair scores of its audit split; `ungated`: a gated
    judge's own scores without its topic gate (stage 03 writes both; {} where there are none)."""
    path = run / f"{split}_scores.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen, rejected = ("chosen_ungated", "rejected_ungated") if ungated else ("chosen_score", "rejected_score")
    if any(chosen not in r for r in rows):
        return {}
    return {r["id"]: float(w) for r, w in zip(rows, wins([r[chosen] for r in rows], [r[rejected] for r in rows]))}


UNGATED = " without its gate"  # a lever row's `against`: the same trained judge, read without its topic gate


def lever_row(lever: str, name: str, against: str, runs: dict[str, Path], rows: dict) -> dict:
    """`name` against `against` on the dev_later pairs both judged: accuracies and the paired gain, 95% intervals.
    `against` may be `NAME without its gate` (UNGATED): that judge's own scores without its topic gate."""
    a = correct_on(runs[name])
    plain = against.removesuffix(UNGATED)
    b = correct_on(runs[plain], ungated=against != plain)
    ids = sorted(set(a) & set(b))
    gain = np.array([a[i] - b[i] for i in ids])
    return {"lever": lever, "judge": name, "against": against, "n_pairs": len(ids),
            "accuracy": rows[name]["dev_later"]["accuracy"], "accuracy_ci95": rows[name]["dev_later"]["accuracy_ci95"],
            "against_accuracy": rows[against]["dev_later"]["accuracy"] if against == plain
            else float(np.mean(list(b.values()))),
            "gain": float(gain.mean()) if ids else None, "gain_ci95": bootstrap_ci(gain) if ids else None,
            "test_accuracy": rows[name]["test"]["accuracy"], "test_accuracy_ci95": rows[name]["test"]["accuracy_ci95"]}


def levers(items: list[str], rows: dict) -> list[dict]:
    """What each lever added on dev_later (module docstring)."""
    runs = _named(items)
    single = [n for n in runs if not is_ensemble(runs[n])]
    base = [n for n in single if "+" not in n]
    reference = "minilm_pairwise" if "minilm_pairwise" in base else (base or single)[0]
    out = [lever_row("features" if n == "features" else "family / recipe", n, reference, runs, rows)
           for n in sorted(base) if n != reference]
    for name in single:
        plain, _, lever = name.rpartition("+")
        if correct_on(runs[name], ungated=True):  # a topic gate: read on the same trained judge, without it
            out.append(lever_row(lever.replace("_", " "), name, name + UNGATED, runs, rows))
            if plain in runs:  # and its plain twin, trained apart from the same recipe: training's own noise
                out.append(lever_row("a second training of the same recipe", plain, name + UNGATED, runs, rows))
        elif plain in runs:
            out.append(lever_row(lever.replace("_", " "), name, plain, runs, rows))
    by_path = {str(run.resolve()): n for n, run in runs.items()}
    for name, run in runs.items():
        if is_ensemble(run):
            made = read_json(run / "ensemble.json")
            members = [by_path[m["path"]] for m in made["members"] if m["path"] in by_path]
            if members:
                best = max(members, key=lambda n: rows[n]["dev_later"]["accuracy"])
                out.append(lever_row(f"ensemble ({made['combine']}, {len(made['members'])} judges)", name, best,
                                     runs, rows))
    return out


def _ci(value, interval, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    f = "{:+.1%}" if sign else "{:.1%}"
    return f"{f.format(value)} [{f.format(interval[0])}, {f.format(interval[1])}]"


def levers_markdown(table: list[dict], reference_note: str) -> str:
    lines = ["# What each lever added on dev_later (later posts; judges chosen here, test only reported)", "",
             reference_note, "",
             "| lever | judge | against | pairs | dev_later accuracy [95% CI] | gain over `against` [paired 95% CI] "
             "| test accuracy [95% CI] |", "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['lever']} | {r['judge']} | {r['against']} | {r['n_pairs']} | "
                     f"{_ci(r['accuracy'], r['accuracy_ci95'])} | {_ci(r['gain'], r['gain_ci95'], sign=True)} | "
                     f"{_ci(r['test_accuracy'], r['test_accuracy_ci95'])} |")
    return "\n".join(lines) + "\n"


def write_levers(out_dir: Path, out: dict) -> None:
    """OUT_DIR/judges_later_posts.md: the levers table of the summary `out`."""
    (Path(out_dir) / "judges_later_posts.md").write_text(levers_markdown(
        out["levers"], "Each row: the judge against the one it adds a lever to (paired on the same pairs). "
                       "Baselines on dev_later: bag-of-words " f"{out['baselines']['bag_of_words']['dev_later']:.1%}, "
                       f"length-only {out['baselines']['length_only']['dev_later']:.1%}."))


def summary(out_dir: Path, items: list[str], ensemble: Path | None, failed: list[str] = ()) -> dict:
    judges = {name: judge_row(run) for name, run in _named(items).items()}
    default = best(items)[0]  # the training judge: `best` below
    judges[default]["default"] = True
    out = {"splits": SPLITS, "chosen_on": "dev_later", "judges": judges, "failed": list(failed),
           "baselines": {name: {split: judges[default][split][name] for split in SPLITS}
                         for name in ("bag_of_words", "length_only")}}
    if ensemble:
        made = read_json(ensemble)
        first = next(row for row in judges.values() if row["run"] == made["runs"][0])
        out["judges"]["ensemble"] = {
            "runs": made["runs"],  # the baselines: the same train pairs, dev_later and test as its judges
            **{split: {**made[split]["ensemble"], "period": first[split]["period"],
                       "n_pairs": first[split]["n_pairs"], "length_only": first[split]["length_only"],
                       "bag_of_words": first[split]["bag_of_words"]} for split in ("dev_later", "test")},
            "gain_over_best_on_dev_later": made["dev_later"]["ensemble_gain_over_best"]}
    for row in out["judges"].values():
        row["meets_target_on_later_posts"] = meets_target(row)
    test = judges[default]["test"]
    out["targets"] = {"default_test_interval_above_bag_of_words": test["accuracy_ci95"][0] > test["bag_of_words"],
                      "default_test_mean_at_least_0.65": test["accuracy"] >= 0.65}
    out["levers"] = levers(items, judges)
    write_levers(out_dir, out)
    write_json(Path(out_dir) / "judges_later_posts.json", out)
    return out


def add_lever(out_dir: Path, lever: str, item: str, against: str) -> dict:
    """One more judge and its lever row in OUT_DIR/judges_later_posts.json and .md (module docstring)."""
    path = Path(out_dir) / "judges_later_posts.json"
    out = read_json(path)
    runs = _named([item, against])
    (name, run), (plain, _) = runs.items()
    row = judge_row(run)
    out["judges"][name] = {**row, "meets_target_on_later_posts": meets_target(row)}
    rows = {n: out["judges"][n] for n in runs}
    out["levers"] = [r for r in out["levers"] if r["judge"] != name] + [lever_row(lever, name, plain, runs, rows)]
    write_levers(out_dir, out)
    write_json(path, out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pick = sub.add_parser("best2")
    pick.add_argument("--k", type=int, default=2)
    pick.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    one = sub.add_parser("best")
    one.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    fams = sub.add_parser("families")
    fams.add_argument("--not", dest="not_of", required=True, metavar="NAME")
    fams.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    summ = sub.add_parser("summary")
    summ.add_argument("out_dir", type=Path)
    summ.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    summ.add_argument("--ensemble", type=Path)
    summ.add_argument("--failed", nargs="*", default=[], metavar="NAME", help="candidates that did not finish")
    more = sub.add_parser("add_lever")
    more.add_argument("out_dir", type=Path)
    more.add_argument("lever")
    more.add_argument("judge", metavar="NAME=REWARD_RUN")
    more.add_argument("against", metavar="NAME=REWARD_RUN")
    args = parser.parse_args(argv)
    if args.command == "best2":
        print("\n".join(map(str, best2(args.judges, args.k))))
    elif args.command == "best":
        name, run = best(args.judges)
        print(f"best: {name} {run}")
    elif args.command == "families":
        for name, run, fam in families(args.judges, args.not_of):  # no line at all where no other family is
            print(f"{name} {run} {fam}")
    elif args.command == "add_lever":
        add_lever(args.out_dir, args.lever, args.judge, args.against)
    else:
        summary(args.out_dir, args.judges, args.ensemble, args.failed)


if __name__ == "__main__":
    main()
