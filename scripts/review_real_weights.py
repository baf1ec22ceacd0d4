"""The two steps of scripts/review_real_weights.sh that are not stages.

    python scripts/review_real_weights.py pick EVAL_RUN ...     # the dev runs, one per decoding
    python scripts/review_real_weights.py summary EVAL_RUN OUT_DIR --sweep EVAL_RUN ...

`pick` reads the dev-split eval runs of the SFT model, one per decoding, and prints three lines: the
decoding flags of the run with the highest format compliance (ties: the lower rating MAE over all
papers), then `--reading first_window|all_windows`, whichever read-out had the lower MAE on every dev
paper in that run, then that run's path. Only dev papers are read: the test split is scored once, after the
choice.

`summary` writes OUT_DIR/review_real_weights.json (the test table: per model its overlap and rating
metrics with intervals and `n`, the baselines, the dev sweep, each preference run's curves and last
values) and OUT_DIR/review_preference_curves.png (loss, reward margin and accuracy per step).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_json, read_jsonl, write_json  # noqa: E402
from common.watch import distinct_n, looped  # noqa: E402

DECODING_FIELDS = ("repetition_penalty", "no_repeat_ngram_size", "temperature")


def config_of(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def sweep_row(run: Path) -> dict:
    """One dev run of the SFT model: its decoding and what it gave."""
    config, results = config_of(run), read_json(run / "eval.json")["sft"]
    replies = [row["sft"]["reply"] for _, row in read_jsonl(run / "replies.jsonl")]
    every = results.get("all_papers", {})
    return {"run": run.name, **{k: config[k] for k in DECODING_FIELDS},
            "format_compliance": results["format_compliance"], "looped_share": sum(map(looped, replies)) / len(replies),
            "distinct_2": distinct_n(replies, 2), "reply_words_mean": results["reply_words_mean"],
            "bleu4": results["bleu4"], "rougeL": results["rougeL"], "rating_mae_all_papers": every.get("rating_mae"),
            "readout_first_window_mae": results.get("readout_first_window", {}).get("rating_mae"),
            "readout_all_windows_mae": results.get("readout_all_windows", {}).get("rating_mae")}


def pick(runs: list[Path]) -> tuple[dict, str]:
    rows = [sweep_row(r) for r in runs]
    best = max(rows, key=lambda r: (r["format_compliance"], -(r["rating_mae_all_papers"] or 99)))
    first, every = best["readout_first_window_mae"], best["readout_all_windows_mae"]
    reading = "all_windows" if every is not None and first is not None and every < first else "first_window"
    return best, reading


def preference_run(run: Path) -> dict:
    manifest, metrics = read_json(run / "manifest.json"), read_json(run / "metrics.json")
    keys = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
    steps = [{"step": e["step"], **{k: e[k] for k in keys if k in e}} for e in metrics["log_history"] if "loss" in e]
    return {"run": run.name, "loss": config_of(run)["loss"], "rejected_from": manifest.get("rejected_from"),
            "n_pairs": metrics.get("n_pairs"), "last": metrics.get("preference"),
            "n_rejected_empty": metrics.get("n_rejected_empty"), "steps": steps}


def label(name: str, runs: dict) -> str:
    """Eval's model name -> what it is: dpo (base-rejected), dpo (sft-rejected), orpo, ..."""
    if name not in runs:
        return name
    run = runs[name]
    return f"{run['loss']} ({run['rejected_from']}-rejected)"


def summary(eval_run: Path, out: Path, sweep: list[Path]) -> None:
    manifest, results = read_json(eval_run / "manifest.json"), read_json(eval_run / "eval.json")
    config = config_of(eval_run)
    policies = {k: Path(v["path"]) for k, v in manifest["inputs"].items() if k.startswith("policy_runs")}
    names = [n for n in results if isinstance(results[n], dict) and "bleu4" in results[n]]
    adapters = [n for n in names if n not in ("base", "sft", "rerank_by_rating", "best_of_n")]  # the policy runs
    runs = {name: preference_run(policies[f"policy_runs[{i}]"]) for i, name in enumerate(adapters)}
    keep = ("n", "bleu4", "rouge1", "rouge2", "rougeL", "reply_words_mean", "format_compliance", "n_rated",
            "rating_mae", "rating_mae_ci", "rating_rmse", "rating_rmse_ci", "rating_pearson", "rating_pearson_ci",
            "all_papers", "readout_first_window", "readout_all_windows", "generation")
    data = {"eval_run": eval_run.name, "commit": manifest.get("git", {}).get("commit"),
            "dirty": manifest.get("git", {}).get("dirty"), "split": config["split"],
            "decoding": {k: config[k] for k in DECODING_FIELDS}, "reading": config["reading"],
            "models": {label(n, runs): {k: results[n][k] for k in keep if k in results[n]} for n in names},
            "baseline_constant": results["baseline_constant"], "baseline_human": results["baseline_human"],
            "rating_sources": results.get("rating_sources"),
            "dev_sweep": [sweep_row(r) for r in sweep], "preference_runs": list(runs.values())}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "review_real_weights.json", data)
    if runs:  # PREFERENCE=0: no DPO or ORPO, no curves
        plot_curves(list(runs.values()), out / "review_preference_curves.png")
    print(f"summary: {(out / 'review_real_weights.json').resolve()}")


def plot_curves(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("loss", "loss"), ("rewards/margins", "reward margin (chosen - rejected)"),
              ("rewards/accuracies", "reward accuracy"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=100)
    for ax, (key, title) in zip(axes, panels):
        for run in runs:
            points = [(s["step"], s[key]) for s in run["steps"] if key in s]
            if points:
                ax.plot(*zip(*points), marker=".", label=f"{run['loss']} ({run['rejected_from']}-rejected)")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pick")
    p.add_argument("runs", nargs="+", type=Path)
    s = sub.add_parser("summary")
    s.add_argument("eval_run", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--sweep", nargs="*", type=Path, default=[])
    args = parser.parse_args(argv)
    if args.command == "pick":
        best, reading = pick(args.runs)
        print(" ".join(f"--{k} {best[k]}" for k in DECODING_FIELDS))
        print(f"--reading {reading}")
        print(next(run for run in args.runs if run.name == best["run"]))
    else:
        summary(args.eval_run, args.out, args.sweep)


if __name__ == "__main__":
    main()
