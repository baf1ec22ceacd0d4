"""The evaluation report: a metrics table and sample replies side by side, in Markdown."""
from __future__ import annotations

from pathlib import Path


def _cell(text: str, max_words: int = 120) -> str:
    words = text.split()
    short = " ".join(words[:max_words]) + (" …" if len(words) > max_words else "")
    return short.replace("|", "\\|").replace("\n", " ") or "*(empty)*"


def write_report(path: Path, run_name: str, results: dict, premises: list[dict], replies: dict,
                 rewards: dict, n_samples: int) -> Path:
    names = list(results)
    lines = [f"# Evaluation {run_name}", "",
             f"{len(premises)} held-out premises; greedy replies; reward = the stage-03 judge's score; "
             "win rate = share of premises where the judge prefers the model's reply to the base's "
             "(ties half), with a 95% bootstrap interval; BLEU/ROUGE-L against the winning reply.", "",
             "| model | reward (mean) | win rate vs base [95% CI] | BLEU | ROUGE-L | words (mean) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in names:
        r = results[name]
        low, high = r["win_rate_vs_base_ci95"]
        lines.append(f"| {name} | {r['reward_mean']:.3f} | {r['win_rate_vs_base']:.2f} [{low:.2f}, {high:.2f}] "
                     f"| {r['bleu']:.2f} | {r['rougeL']:.3f} | {r['reply_words_mean']:.0f} |")
    lines += ["", "## Sample replies", ""]
    for i, premise in enumerate(premises[:n_samples]):
        lines += [f"### {i + 1}. {_cell(premise['premise'].splitlines()[0], 30)}", "",
                  f"> {_cell(premise['premise'], 80)}", "",
                  "| " + " | ".join(f"{n} (reward {rewards[n][i]:.2f})" for n in names) + " | winning reply |",
                  "| " + " | ".join("---" for _ in names) + " | --- |",
                  "| " + " | ".join(_cell(replies[n][i]) for n in names) + f" | {_cell(premise['chosen'])} |", ""]
    path.write_text("\n".join(lines) + "\n")
    return path
