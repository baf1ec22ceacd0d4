"""The summary of scripts/persuasion_real_weights.sh.

    python scripts/persuasion_real_weights.py EVAL_RUN OUT_DIR

Writes OUT_DIR/persuasion_real_weights.json: for each model (base, sft, grpo, dpo, orpo) and each
judge (the training judge, the held-out one), the mean reward, the win rate and length-controlled
win rate vs the base and vs SFT with 95% intervals, reply words and distinct-2, `n`; for each judge
its accuracy on the test pairs with its interval beside length-only and bag-of-words (its
judge_audit.json); the GRPO run's per-step reward and reward-hacking watch; and the report's verdict
lines (a gain under the training judge that the held-out judge does not confirm, or that length
explains).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.data import read_json, write_json  # noqa: E402
from common.judges import gain_lines  # noqa: E402

KEYS = ("reward_mean", "win_rate_vs_base", "win_rate_vs_base_ci95", "lc_win_rate_vs_base", "lc_win_rate_vs_base_ci95",
        "win_rate_vs_sft", "win_rate_vs_sft_ci95", "lc_win_rate_vs_sft", "lc_win_rate_vs_sft_ci95")


def judge_on_test(run: Path) -> dict:
    """The judge's accuracy on the test pairs (those stage 05's premises come from) and both baselines."""
    audit = read_json(run / "judge_audit.json")
    judged = audit["judge"] if audit["split"] == "test" else audit["other_splits"]["test"]
    return {"run": run.name, "train_split": read_json(run / "metrics.json").get("train_split"),
            "n_pairs": judged["n_pairs"], "accuracy": judged["accuracy"], "accuracy_ci95": judged["accuracy_ci95"],
            "length_only": audit["baselines"]["length_only"]["test_accuracy"],
            "bag_of_words": audit["baselines"]["bag_of_words"]["test_accuracy"]}


def summary(eval_run: Path, out: Path) -> dict:
    manifest, results = read_json(eval_run / "manifest.json"), read_json(eval_run / "eval.json")
    judges = results["judges"]
    paths = {Path(v["path"]).name: Path(v["path"]) for k, v in manifest["inputs"].items()
             if k == "reward_run" or k.startswith("judge_runs")}
    models = [n for n in results if isinstance(results[n], dict) and "by_judge" in results[n]]
    policies = [Path(v["path"]) for k, v in manifest["inputs"].items() if k.startswith("policy_runs")]
    grpo = next((p for p in policies if read_json(p / "manifest.json")["stage"] == "GRPO"), None)
    data = {"eval_run": eval_run.name, "commit": manifest.get("git", {}).get("commit"),
            "n_premises": results[models[0]]["n"],
            "judges": {name: {"role": j["role"], **judge_on_test(paths[name])} for name, j in judges.items()},
            "models": {m: {"n": results[m]["n"], "reply_words_mean": results[m]["reply_words_mean"],
                           "distinct_2": results[m].get("distinct_2"), "bleu4": results[m]["bleu4"],
                           "rougeL": results[m]["rougeL"],
                           "by_judge": {j: {k: v for k, v in results[m]["by_judge"][j].items() if k in KEYS}
                                        for j in judges}} for m in models},
            "grpo_per_step": read_json(grpo / "metrics.json").get("per_step") if grpo else None,
            "verdict": gain_lines({m: results[m] for m in models}, judges)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "persuasion_real_weights.json", data)
    print(f"summary: {(out / 'persuasion_real_weights.json').resolve()}")
    return data


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    summary(Path(sys.argv[1]), Path(sys.argv[2]))
