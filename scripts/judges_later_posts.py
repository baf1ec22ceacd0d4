"""The two steps of scripts/judges_later_posts.sh that are not stages.

    python scripts/judges_later_posts.py best2 NAME=REWARD_RUN ...     # the two judges best on dev
    python scripts/judges_later_posts.py summary OUT_DIR NAME=REWARD_RUN ... --ensemble ENSEMBLE_JSON

`best2` prints the run directories (one a line) of the two judges with the highest dev (in-period) accuracy: the
choice is made on dev, never on the later posts of test. `summary` writes OUT_DIR/judges_later_posts.json:
for each judge (and the ensemble of scripts/judge_ensemble.py), its run, its accuracy with a 95%
interval on dev (in-period) and test (later posts), the length-only and bag-of-words baselines on each
(from its judge_audit.json), and whether its test interval lies above 0.5 and above bag-of-words.
An early-stopped judge chose its epoch on dev: its dev accuracy is optimistic, its test one is not.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_json, write_json  # noqa: E402

SPLITS = {"dev": "in-period", "test": "later posts"}


def _named(items: list[str]) -> dict[str, Path]:
    return {name: Path(run) for name, _, run in (item.partition("=") for item in items)}


def judge_row(run: Path) -> dict:
    """A judge's accuracy and both shortcut baselines on dev and test, from its judge_audit.json."""
    audit = read_json(run / "judge_audit.json")
    metrics = read_json(run / "metrics.json")
    row = {"run": run.name, "pairs_run": Path(read_json(run / "manifest.json")["pairs_run"]).name,
           "objective": metrics.get("judge_objective"), "early_stopping": metrics.get("early_stopping")}
    for split, period in SPLITS.items():
        judged = audit["judge"] if audit["split"] == split else audit["other_splits"][split]
        row[split] = {"period": audit["periods"].get(split, period), "n_pairs": judged["n_pairs"],
                      "accuracy": judged["accuracy"], "accuracy_ci95": judged["accuracy_ci95"],
                      "length_only": audit["baselines"]["length_only"][f"{split}_accuracy"],
                      "bag_of_words": audit["baselines"]["bag_of_words"][f"{split}_accuracy"]}
    return row


def meets_target(row: dict) -> bool:
    """On later posts: the interval above chance and above bag-of-words' point estimate."""
    test = row["test"]
    return test["accuracy_ci95"][0] > max(0.5, test["bag_of_words"])


def best2(items: list[str]) -> list[Path]:
    runs = _named(items)
    return sorted(runs.values(), key=lambda r: -judge_row(r)["dev"]["accuracy"])[:2]


def summary(out_dir: Path, items: list[str], ensemble: Path | None) -> dict:
    judges = {name: judge_row(run) for name, run in _named(items).items()}
    out = {"splits": SPLITS, "judges": judges}
    if ensemble:
        made = read_json(ensemble)
        first = next(row for row in judges.values() if row["run"] == made["runs"][0])
        out["judges"]["ensemble"] = {
            "runs": made["runs"],  # the baselines: the same train pairs, dev and test as its judges
            **{split: {**made[split]["ensemble"], "period": first[split]["period"],
                       "n_pairs": first[split]["n_pairs"], "length_only": first[split]["length_only"],
                       "bag_of_words": first[split]["bag_of_words"]} for split in SPLITS},
            "gain_over_best_on_dev": made["dev"]["ensemble_gain_over_best"]}
    for row in out["judges"].values():
        row["meets_target_on_later_posts"] = meets_target(row)
    write_json(Path(out_dir) / "judges_later_posts.json", out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pick = sub.add_parser("best2")
    pick.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    summ = sub.add_parser("summary")
    summ.add_argument("out_dir", type=Path)
    summ.add_argument("judges", nargs="+", metavar="NAME=REWARD_RUN")
    summ.add_argument("--ensemble", type=Path)
    args = parser.parse_args(argv)
    if args.command == "best2":
        print("\n".join(map(str, best2(args.judges))))  # one a line: a path may hold spaces
    else:
        summary(args.out_dir, args.judges, args.ensemble)


if __name__ == "__main__":
    main()
