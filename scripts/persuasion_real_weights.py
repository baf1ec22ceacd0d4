"""The steps of scripts/persuasion_real_weights.sh that are not stages.

    python scripts/persuasion_real_weights.py framing OUT_DIR NAME=EVAL_RUN ...    # prints the chosen pairs run
    python scripts/persuasion_real_weights.py decoding OUT_DIR NAME=EVAL_RUN ...   # prints the chosen decoding
    python scripts/persuasion_real_weights.py rising NAME=GRPO_RUN ...             # GRPO runs, most risen first
    python scripts/persuasion_real_weights.py summary EVAL_RUN OUT_DIR NAME=GRPO_RUN ...

`framing` reads stage-05 runs of the base model on the dev premises, one per prompt framing (each on its own
pairs run, scored by a judge trained on it), writes OUT_DIR/persuasion_framing_sweep.json and prints the chosen
framing's pairs run. The rule: the framings whose base replies are refused least (within 0.02 of the lowest
refusal share), and among them the highest judge reward. `decoding` reads stage-05 runs on the dev premises, one per decoding (base and SFT, the training judge),
writes OUT_DIR/persuasion_decoding_sweep.json and prints the chosen decoding's arguments. The rule: the
decodings whose replies loop least (the lowest looped share of base and SFT, within 0.02 of the best),
and among them the highest training-judge reward averaged over base and SFT. `rising` orders GRPO runs
by how far their own reward rose: the mean of the last quarter of steps minus the first quarter's, in
units of its standard error (the step-to-step sd), a training signal, never a test score.
`summary` writes OUT_DIR/persuasion_real_weights.json: `models` (every model of the eval with `n`,
looped_share, premise_copy_share, distinct_2, refusal_share, conceded_share (null for an eval from before it),
reply words, cut_share, and per judge its reward and win rates vs the base and vs SFT with 95% intervals),
`judges` (each with its `role` and its accuracy on the test pairs beside both baselines), the verdict lines,
each GRPO run's reward curve, the rise and its checkpoint choice on dev (`on_dev`), `grpo_chosen_on_dev` (the
recipe whose chosen step wins most against the start on dev: how a sweep of one recipe's beta is decided, never on
the test premises) with `grpo_chosen_on_dev_model` (its row in the eval) and `grpo_chosen_on_dev_verdict` (that
row's verdict line, also printed), and the plot persuasion_grpo_rewards.png. It prints each model's verdict,
without the judges' figures, for the chain's log.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_json, write_json  # noqa: E402
from common.verdict import verdict_head  # noqa: E402

KEYS = ("reward_mean", "win_rate_vs_base", "win_rate_vs_base_ci95", "lc_win_rate_vs_base", "lc_win_rate_vs_base_ci95",
        "win_rate_vs_sft", "win_rate_vs_sft_ci95", "lc_win_rate_vs_sft", "lc_win_rate_vs_sft_ci95")
SHAPE = ("looped_share", "premise_copy_share", "distinct_2", "refusal_share", "conceded_share", "reply_words_mean")
DECODING = ("temperature", "repetition_penalty", "no_repeat_ngram_size")


def _named(items: list[str]) -> dict[str, Path]:
    return {name: Path(run) for name, _, run in (item.partition("=") for item in items)}


def _guarded_best(rows: dict, fault, score, slack: float = 0.02) -> str:
    """The dev sweeps' rule: among the rows whose `fault` (a share to keep low) is within `slack` of the
    lowest, the one with the highest `score`."""
    low = min(fault(r) for r in rows.values())
    return max((n for n, r in rows.items() if fault(r) <= low + slack), key=lambda n: score(rows[n]))


def framing(out_dir: Path, items: list[str]) -> str:
    rows = {}
    for name, run in _named(items).items():
        base, manifest = read_json(run / "eval.json")["base"], read_json(run / "manifest.json")
        rows[name] = {"run": run.name, "pairs_run": manifest["pairs_run"], "refusal_share": base["refusal_share"],
                      "reward_mean": base["reward_mean"], "reply_words_mean": base["reply_words_mean"],
                      "looped_share": base["looped_share"], "premise_copy_share": base["premise_copy_share"]}
    chosen = _guarded_best(rows, lambda r: r["refusal_share"], lambda r: r["reward_mean"])
    write_json(Path(out_dir) / "persuasion_framing_sweep.json", {"split": "dev", "model": "base", "chosen": chosen,
                                                                  "framings": rows})
    return rows[chosen]["pairs_run"]


def decoding(out_dir: Path, items: list[str]) -> str:
    rows = {}
    for name, run in _named(items).items():
        results, config = read_json(run / "eval.json"), read_json(run / "manifest.json")["decoding"]
        rows[name] = {"run": run.name, **{k: config[k] for k in DECODING},
                      **{f"{model}_{k}": results[model].get(k) for model in ("base", "sft") for k in SHAPE},
                      **{f"{model}_reward_mean": results[model]["reward_mean"] for model in ("base", "sft")},
                      "sft_win_rate_vs_base": results["sft"]["win_rate_vs_base"]}
    chosen = _guarded_best(rows, lambda r: max(r["base_looped_share"], r["sft_looped_share"]),
                           lambda r: (r["base_reward_mean"] + r["sft_reward_mean"]) / 2)
    write_json(Path(out_dir) / "persuasion_decoding_sweep.json", {"split": "dev", "chosen": chosen, "decodings": rows})
    c = rows[chosen]
    return (f"--temperature {c['temperature']} --repetition_penalty {c['repetition_penalty']} "
            f"--no_repeat_ngram_size {c['no_repeat_ngram_size']}")


def rise(run: Path) -> dict:
    """The GRPO run's own reward per step, and how far it rose beyond its step-to-step noise."""
    steps = [s["reward_mean"] for s in read_json(run / "metrics.json").get("per_step") or [] if s["reward_mean"] is not None]
    q = max(1, len(steps) // 4)
    if len(steps) < 4:
        return {"rewards": steps, "rise": None, "rise_in_se": None}
    diffs = [b - a for a, b in zip(steps, steps[1:])]
    sd = math.sqrt(sum(d * d for d in diffs) / len(diffs) / 2)  # a step's own noise (differences have twice it)
    gain = sum(steps[-q:]) / q - sum(steps[:q]) / q
    return {"rewards": steps, "rise": gain, "rise_in_se": gain / (sd * math.sqrt(2 / q)) if sd else None}


def on_dev(run: Path) -> dict | None:
    """A GRPO run's checkpoint choice on the dev premises (stage 04): the chosen step, its replies' win rate
    against the start's (SFT's, for every recipe that starts from it) and their fluency; None for a run that
    chose none."""
    choice = read_json(run / "metrics.json").get("checkpoint_choice") if (run / "metrics.json").is_file() else None
    if not choice:
        return None
    point = next(p for p in choice["curve"] if p["step"] == choice["chosen_step"])
    if "win_rate_vs_start" not in point:  # a run from before the choice read win rates
        return None
    return {"chosen_step": choice["chosen_step"], "dev_judges": choice["dev_judges"], "premises": choice["premises"],
            "win_rate_vs_start": point["win_rate_vs_start"], "fluency": point["fluency"]}


def best_on_dev(curves: dict) -> str | None:
    """The GRPO recipe chosen on dev (a sweep of the KL anchor's beta, say): among those whose checkpoints were
    chosen by the same dev judges on as many premises, the one whose chosen step wins most against the start
    (each step passed its run's fluency check already). None when they were not scored alike."""
    scored = {n: c["on_dev"] for n, c in curves.items() if c.get("on_dev")}
    if len({(tuple(d["dev_judges"]), d["premises"]) for d in scored.values()}) != 1:
        return None
    return max(scored, key=lambda n: scored[n]["win_rate_vs_start"])


def rising(items: list[str]) -> list[Path]:
    runs = _named(items)
    return sorted(runs.values(), key=lambda r: -(rise(r)["rise_in_se"] or -math.inf))


def judge_on_test(path: Path | None, info: dict) -> dict:
    """The judge's accuracy on the test pairs (those stage 05's premises come from) and both baselines. A
    cross-fit's folds each report their left-out fold: pooled, with a Wilson interval."""
    if path is None:
        folds = [Path(p) for p in info["path"]]
        n = correct = 0
        for fold in folds:
            audit = read_json(fold / "judge_audit.json")
            split = next(s for s in audit["other_splits"] if s.startswith("test_fold"))
            n += audit["other_splits"][split]["n_pairs"]
            correct += audit["other_splits"][split]["accuracy"] * audit["other_splits"][split]["n_pairs"]
        return {"runs": [f.name for f in folds], "n_pairs": n, "accuracy": correct / n if n else None,
                "accuracy_ci95": _wilson(correct, n), "interval": "Wilson, pooled over the folds"}
    audit = read_json(path / "judge_audit.json")
    judged = audit["judge"] if audit["split"] == "test" else audit["other_splits"]["test"]
    return {"run": path.name, "train_split": read_json(path / "metrics.json").get("train_split"),
            "n_pairs": judged["n_pairs"], "accuracy": judged["accuracy"], "accuracy_ci95": judged["accuracy_ci95"],
            "length_only": audit["baselines"]["length_only"].get("test_accuracy"),
            "bag_of_words": audit["baselines"]["bag_of_words"].get("test_accuracy")}


def _wilson(correct: float, n: int) -> list[float] | None:
    if not n:
        return None
    p, z = correct / n, 1.96
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [centre - half, centre + half]


def summary(eval_run: Path, out: Path, grpo_items: list[str]) -> dict:
    manifest, results, metrics = (read_json(eval_run / f) for f in ("manifest.json", "eval.json", "metrics.json"))
    judges = results["judges"]
    paths = {Path(v["path"]).name: Path(v["path"]) for k, v in manifest["inputs"].items()
             if k == "reward_run" or k.startswith("judge_runs")}
    models = [n for n in results if isinstance(results[n], dict) and "by_judge" in results[n]]
    curves = {name: {"run": run.name, "stopped_by_length_guard": not (run / "DONE").exists(), **rise(run),
                     "on_dev": on_dev(run)} for name, run in _named(grpo_items).items()}
    data = {"eval_run": eval_run.name, "commit": manifest.get("git", {}).get("commit"),
            "n_premises": results[models[0]]["n"], "decoding": manifest.get("decoding"),
            "best_of_n": manifest.get("best_of_n"), "verdict": metrics.get("verdict"),
            "judges": {name: {"role": j["role"], "family": j.get("family"), **judge_on_test(paths.get(name), j)}
                       for name, j in judges.items()},
            "models": {m: {"n": results[m]["n"], **{k: results[m].get(k) for k in SHAPE},
                           "cut_share": results[m].get("cut_share"),  # None: replies from before it was recorded
                           "bleu4": results[m]["bleu4"], "rougeL": results[m]["rougeL"],
                           "by_judge": {j: {k: v for k, v in results[m]["by_judge"][j].items() if k in KEYS}
                                        for j in judges}} for m in models},
            "grpo_recipes": curves, **chosen_on_dev(curves, results, metrics.get("verdict") or [])}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "persuasion_real_weights.json", data)
    plot_rewards(curves, out / "persuasion_grpo_rewards.png")
    # the verdict in the chain's own log (a Slurm job's output), each model's line without the judges' figures
    for model, r in results.items():
        if isinstance(r, dict) and r.get("verdict"):
            print("verdict: " + verdict_head(model, r["verdict"]).replace("**", ""))
    if data["grpo_chosen_on_dev"]:
        print(f"GRPO recipe chosen on dev: {data['grpo_chosen_on_dev']} (the eval's {data['grpo_chosen_on_dev_model']}); "
              f"its verdict on test: {data['grpo_chosen_on_dev_verdict'] or 'none'}")
    print(f"summary: {(out / 'persuasion_real_weights.json').resolve()}")
    return data


def chosen_on_dev(curves: dict, results: dict, verdict: list[str]) -> dict:
    """The GRPO recipe chosen on dev (`best_on_dev`), the eval's name for its row and that row's verdict line: the
    practised policy a researcher may call the result without choosing on the test premises."""
    name = best_on_dev(curves)
    model = next((m for m, r in results.items() if name and isinstance(r, dict) and r.get("run") == curves[name]["run"]),
                 None)
    line = next((v for v in verdict if model and v.startswith(f"**{model}** ")), None)
    return {"grpo_chosen_on_dev": name, "grpo_chosen_on_dev_model": model, "grpo_chosen_on_dev_verdict": line}


def plot_rewards(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        label = name + (f" (rise {curve['rise_in_se']:+.1f} se)" if curve["rise_in_se"] is not None else "") \
            + (" (stopped by its length guard)" if curve.get("stopped_by_length_guard") else "")
        ax.plot(range(1, len(curve["rewards"]) + 1), curve["rewards"], label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("training judge's mean reward on the rollouts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    fra = sub.add_parser("framing")
    fra.add_argument("out_dir", type=Path)
    fra.add_argument("runs", nargs="+", metavar="NAME=EVAL_RUN")
    dec = sub.add_parser("decoding")
    dec.add_argument("out_dir", type=Path)
    dec.add_argument("runs", nargs="+", metavar="NAME=EVAL_RUN")
    up = sub.add_parser("rising")
    up.add_argument("runs", nargs="+", metavar="NAME=GRPO_RUN")
    summ = sub.add_parser("summary")
    summ.add_argument("eval_run", type=Path)
    summ.add_argument("out_dir", type=Path)
    summ.add_argument("runs", nargs="*", metavar="NAME=GRPO_RUN")
    args = parser.parse_args(argv)
    if args.command == "framing":
        print(framing(args.out_dir, args.runs))
    elif args.command == "decoding":
        print(decoding(args.out_dir, args.runs))
    elif args.command == "rising":
        print("\n".join(map(str, rising(args.runs))))
    else:
        summary(args.eval_run, args.out_dir, args.runs)


if __name__ == "__main__":
    main()
