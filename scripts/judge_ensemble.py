"""Would two judges together pick winners better than either alone? (docs/results.md, "A stronger judge")

    .venv/bin/python scripts/judge_ensemble.py runs/Nov30_Reward_Run1 runs/Nov30_Reward_Run2

Both finished stage-03 runs must be on the same pairs run. Each judge scores the dev_later and test pairs;
its scores are standardised with the mean and sd of its own dev_later scores (a pairwise judge's margins
and a pointwise judge's logits are on different scales), and the ensemble's score is the mean of the
two. Prints, as JSON, each judge's and the ensemble's accuracy with a 95% bootstrap interval per
split, and the paired bootstrap interval of the ensemble's gain over the better single judge (on dev_later). The
choice is made on dev_later; test is the number to report.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import DataError, load_split, read_json  # noqa: E402
from common.metrics import bootstrap_ci, wins  # noqa: E402
from common.runs import RunError, require_done  # noqa: E402
from common.scorers import load_scorer  # noqa: E402


def main(runs: list[str]) -> dict:
    pairs_runs = {require_done(r).get("pairs_run") for r in runs}
    if len(runs) != 2 or len(pairs_runs) != 1:
        raise SystemExit("error: give two finished Reward runs of the same pairs run")
    pairs_run = pairs_runs.pop()
    splits = {s: load_split(pairs_run, s) for s in ("dev_later", "test")}
    scores = {}  # run -> split -> (chosen, rejected)
    for run in runs:
        judge = load_scorer(f"run:{run}", batch_size=32)  # any judge run: 4-bit, encoder, features
        scores[run] = {s: tuple(np.asarray(judge.score([r["prompt"] for r in rows], [r[k] for r in rows]))
                                for k in ("chosen", "rejected")) for s, rows in splits.items()}
        del judge
    out = {"runs": [Path(r).name for r in runs], "pairs_run": pairs_run,
           "objectives": [read_json(Path(r) / "metrics.json").get("judge_objective", "pairwise") for r in runs]}
    for split in splits:
        correct = {}
        for run in runs:
            c, r = scores[run][split]
            correct[Path(run).name] = wins(c, r)
        z = []
        for run in runs:
            dev = np.concatenate(scores[run]["dev_later"])
            c, r = scores[run][split]
            z.append(((c - dev.mean()) / dev.std(), (r - dev.mean()) / dev.std()))
        correct["ensemble"] = wins((z[0][0] + z[1][0]) / 2, (z[0][1] + z[1][1]) / 2)
        if split == "dev_later":  # the better single judge is chosen on dev_later, like the ensemble
            best = max(out["runs"], key=lambda n: correct[n].mean())
        out[split] = {name: {"accuracy": float(v.mean()), "accuracy_ci95": bootstrap_ci(v)} for name, v in correct.items()}
        out[split]["ensemble_gain_over_best"] = {"best": best, "gain": float((correct["ensemble"] - correct[best]).mean()),
                                                 "gain_ci95": bootstrap_ci(correct["ensemble"] - correct[best])}
    return out


if __name__ == "__main__":  # --out FILE: the JSON there (stdout may carry the libraries' notices)
    args = sys.argv[1:]
    out = Path(args.pop(args.index("--out") + 1)) if "--out" in args else None
    args = [a for a in args if a != "--out"]
    try:
        result = json.dumps(main(args), indent=2)
    except (RunError, DataError) as err:
        sys.exit(f"error: {err}")
    out.write_text(result) if out else print(result)
