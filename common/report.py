"""The evaluation report: a metrics table, length and reward plots, the judge's audit verdict and
sample replies side by side, in Markdown."""
from __future__ import annotations

from pathlib import Path

from common.data import n_words


def plot_distributions(out_dir: Path, replies: dict[str, list[str]], rewards: dict[str, list[float]]) -> dict:
    """Two PNGs (matplotlib, no display): the reply-length (words) and reward distributions of the
    base and each adapter, overlaid. Returns {caption: path}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = {}
    for key, title, xlabel, values in (
            ("reply_length", "Reply length", "words", {n: [n_words(t) for t in r] for n, r in replies.items()}),
            ("reward", "Judge's reward", "reward (stage-03 judge)", rewards)):
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        low = min(min(v) for v in values.values() if v)
        high = max(max(v) for v in values.values() if v)
        bins = 20 if high > low else 1
        for name, vals in values.items():
            ax.hist(vals, bins=bins, range=(low, high if high > low else low + 1), alpha=0.45,
                    label=f"{name} (mean {sum(vals) / max(1, len(vals)):.2f})")
        ax.set_title(f"{title}: base vs adapters")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("premises")
        ax.legend()
        fig.tight_layout()
        path = Path(out_dir) / f"{key}_hist.png"
        fig.savefig(path)
        plt.close(fig)
        plots[f"{title} distribution"] = path
    return plots


def log_plots_to_wandb(plots: dict) -> None:
    """The plots as W&B images, when a W&B run is open."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.log({f"eval/{Path(p).stem}": wandb.Image(str(p), caption=c) for c, p in plots.items()})


def _cell(text: str, max_words: int = 120) -> str:
    words = text.split()
    short = " ".join(words[:max_words]) + (" …" if len(words) > max_words else "")
    return short.replace("|", "\\|").replace("\n", " ") or "*(empty)*"


def write_report(path: Path, run_name: str, results: dict, premises: list[dict], replies: dict,
                 rewards: dict, n_samples: int, plots: dict | None = None, judge_verdict: str | None = None) -> Path:
    names = list(results)
    lines = [f"# Evaluation {run_name}", "",
             f"{len(premises)} held-out premises; greedy replies; reward = the stage-03 judge's score; "
             "win rate = share of premises where the judge prefers the model's reply to the base's "
             "(ties half), with a 95% bootstrap interval; LC win rate = the same preference with the "
             "length effect regressed out (logistic fit of the win on the length difference, read at "
             "equal length, as AlpacaEval's length-controlled win rate); BLEU/ROUGE-L against the "
             "winning reply.", "",
             "| model | reward (mean) | win rate vs base [95% CI] | LC win rate [95% CI] | BLEU | ROUGE-L | words (mean) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        r = results[name]
        low, high = r["win_rate_vs_base_ci95"]
        lc = (f"{r['lc_win_rate_vs_base']:.2f} [{r['lc_win_rate_vs_base_ci95'][0]:.2f}, "
              f"{r['lc_win_rate_vs_base_ci95'][1]:.2f}]") if "lc_win_rate_vs_base" in r else "n/a"
        lines.append(f"| {name} | {r['reward_mean']:.3f} | {r['win_rate_vs_base']:.2f} [{low:.2f}, {high:.2f}] "
                     f"| {lc} | {r['bleu']:.2f} | {r['rougeL']:.3f} | {r['reply_words_mean']:.0f} |")
    if judge_verdict:
        lines += ["", "## The judge", "", f"From the reward run's judge_audit.json: {judge_verdict}"]
    if plots:
        lines += ["", "## Distributions", ""]
        for caption, plot in plots.items():
            lines += [f"![{caption}]({Path(plot).name})", ""]
    lines += ["", "## Sample replies", ""]
    for i, premise in enumerate(premises[:n_samples]):
        lines += [f"### {i + 1}. {_cell(premise['premise'].splitlines()[0], 30)}", "",
                  f"> {_cell(premise['premise'], 80)}", "",
                  "| " + " | ".join(f"{n} (reward {rewards[n][i]:.2f})" for n in names) + " | winning reply |",
                  "| " + " | ".join("---" for _ in names) + " | --- |",
                  "| " + " | ".join(_cell(replies[n][i]) for n in names) + f" | {_cell(premise['chosen'])} |", ""]
    path.write_text("\n".join(lines) + "\n")
    return path
