"""The evaluation report: a metrics table, length and reward plots, the judge's audit verdict and
sample replies side by side, in Markdown."""
from __future__ import annotations

import re
from pathlib import Path

from common.data import n_words


def save_figure(fig, path: Path) -> Path:
    """A finished figure written as PNG and closed (its memory freed): every plot of the stages ends here."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_distributions(out_dir: Path, replies: dict[str, list[str]], rewards: dict[str, list[float]],
                       counted: str = "premises") -> dict:
    """Two PNGs (matplotlib, no display): the reply-length (words) and reward distributions of the
    base and each adapter, overlaid, each bar a number of `counted` (the task's noun). Returns {caption: path}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = {}
    panels = [("reply_length", "Reply length", "words", {n: [n_words(t) for t in r] for n, r in replies.items()})]
    if rewards:  # only with a judge
        panels.append(("reward", "Judge's reward", "reward (stage-03 judge)", rewards))
    for key, title, xlabel, values in panels:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        low = min(min(v) for v in values.values() if v)
        high = max(max(v) for v in values.values() if v)
        bins = 20 if high > low else 1
        for name, vals in values.items():
            ax.hist(vals, bins=bins, range=(low, high if high > low else low + 1), alpha=0.45,
                    label=f"{name} (mean {sum(vals) / max(1, len(vals)):.2f})")
        ax.set_title(f"{title}: base vs adapters")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(counted)
        ax.legend()
        path = save_figure(fig, Path(out_dir) / f"{key}_hist.png")
        plots[f"{title} distribution"] = path
    return plots


def plot_ratings(out_dir: Path, pairs: dict[str, list[tuple[float, float]]]) -> dict:
    """Predicted vs human rating, one colour per model, the diagonal for reference. Returns {caption: path}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    for name, points in pairs.items():
        if points:
            ax.scatter([g for _, g in points], [p for p, _ in points], alpha=0.6, label=f"{name} ({len(points)})")
    ax.plot([1, 6], [1, 6], color="grey", linewidth=1)
    ax.set_xlim(0.8, 6.2)
    ax.set_ylim(0.8, 6.2)
    ax.set_xlabel("human rating (mean of the paper's reviewers)")
    ax.set_ylabel("rating in the generated review")
    ax.set_title("Predicted vs human rating")
    ax.legend()
    path = save_figure(fig, Path(out_dir) / "rating_scatter.png")
    return {"Predicted vs human rating": path}


def plot_watch(out_dir: Path, per_step: dict[str, list[dict]]) -> dict:
    """Each GRPO policy's training, step by step: the training judge's mean reward beside the
    reward-hacking watch (reply words, distinct-2, share of reply 3-grams copied from the premise, share that
    concede), from its run's metrics.json `per_step`. Returns {caption: path}, empty without a GRPO policy."""
    per_step = {name: steps for name, steps in per_step.items() if steps}
    if not per_step:
        return {}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("reward_mean", "training judge's reward"), ("reply_words_mean", "reply words"),
              ("distinct_2", "distinct-2"), ("premise_overlap", "premise 3-grams copied"),
              ("conceded_share", "replies that concede"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), dpi=100)
    for ax, (key, title) in zip(axes, panels):
        for name, steps in per_step.items():
            points = [(s["step"], s[key]) for s in steps if s.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    path = save_figure(fig, Path(out_dir) / "grpo_watch.png")
    return {"GRPO per step: the training judge's reward and the reward-hacking watch": path}


def log_plots_to_wandb(plots: dict) -> None:
    """The plots as W&B images, when a W&B run is open."""
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is not None:
        wandb.log({f"eval/{Path(p).stem}": wandb.Image(str(p), caption=c) for c, p in plots.items()})


_MARKDOWN = re.compile(r"([\\`*\[\]()#!|<>])")


def _one_line(text) -> str:
    """A control character (a newline, a line separator) shown escaped: the text stays on its line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def md(text) -> str:
    """Text a user gave (a run name, a post, a reply) as it should read in markdown: on one line (a
    newline cannot open a heading or a list) and with the marks of links, images, HTML, headings,
    emphasis and table cells backslash-escaped."""
    return _MARKDOWN.sub(r"\\\1", _one_line(text))


def md_code(text) -> str:
    """A file name or path a user gave, as inline code on one line: fenced by more backticks than it holds."""
    text = _one_line(text)
    fence = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str, max_words: int = 120) -> str:
    words = text.split()
    short = " ".join(words[:max_words]) + (" …" if len(words) > max_words else "")
    return md(short) or "*(empty)*"


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _with_ci(r: dict, key: str) -> str:
    if key not in r:
        return "n/a"
    low, high = r[f"{key}_ci95"]
    return f"{r[key]:.2f} [{low:.2f}, {high:.2f}]"


def judges_section(results: dict, judges: dict, lines: list[str]) -> list[str]:
    """Every judge's verdict on every model, one table per judge (its run name, its kind, whether it
    is the training judge or held out), then `lines` (common/judges.gain_lines)."""
    roles = {"training": "the training judge (--reward_run)", "held_out": "held out: no post shared with the "
             "policy's train split or the scored premises", "other": "another judge: it trained on posts of the "
             "policy's train split, none of the scored premises"}
    out = ["", "## Judges", "",
           "The same replies scored by every judge. A policy trained against one judge can learn that judge's blind "
           "spots; a judge it never trained against, on posts it never saw, checks that the gain is real."]
    for name, judge in judges.items():
        gate = f", topic gate {judge['topic_gate']:g}" if judge.get("topic_gate") else ""  # common/topic_gate.py
        out += ["", f"**{md(name)}**: {judge['objective']} {judge['backbone']} judge ({md(judge['model'])}, family "
                f"{md(judge.get('family', 'unknown'))}{gate}), trained on the "
                f"{judge['train_split']} split; {roles[judge['role']]}; {judge.get('period', 'period unknown')}." +
                (f" {judge['description']}" if judge.get("description") else ""), "",
                "| model | reward (mean) | win rate vs base [95% CI] | LC win rate [95% CI] | win rate vs SFT | "
                "LC win rate vs SFT | words (mean) | distinct-2 |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for model, r in results.items():
            j = r["by_judge"][name]
            out.append(f"| {model} | {_fmt(j['reward_mean'])} | {_with_ci(j, 'win_rate_vs_base')} | "
                       f"{_with_ci(j, 'lc_win_rate_vs_base')} | {_with_ci(j, 'win_rate_vs_sft')} | "
                       f"{_with_ci(j, 'lc_win_rate_vs_sft')} | {_fmt(r.get('reply_words_mean'), 0)} | "
                       f"{_fmt(r.get('distinct_2'))} |")
    if lines:
        out += [""] + lines
    return out


def write_report(path: Path, run_name: str, results: dict, premises: list[dict], replies: dict, rewards: dict,
                 n_samples: int, plots: dict | None = None, judge_verdict: str | None = None,
                 sections: list[str] | None = None, reading: str = "the prompt", decoding: str = "greedy", *,
                 display, nouns: dict, headline: list[str] | None = None) -> Path:
    """report.md: the metrics table (judge columns only with a judge), the task's own sections, the
    judge's audit verdict, the plots, and sample replies side by side with the real one. The task
    says how a premise is shown (`display`) and named (`nouns`: premise(s), reference(s))."""
    names = list(results)
    lines = [f"# Evaluation {md(run_name)}", ""]
    if headline:
        lines += ["## Verdict (a gain holds where held-out judges of two families put its 95% interval above 0.5 "
                  "and the replies pass the fluency gate)", "",
                  *[f"- {line}" for line in headline], ""]
    lines += [f"{len(premises)} held-out {nouns['premises']}; {decoding} replies to {reading}; BLEU-4 and ROUGE "
             f"against the {nouns['references']} (every {nouns['reference']} of a {nouns['premise']} is a reference)."]
    if rewards:
        lines += [f"Reward = the stage-03 judge's score; win rate = share of {nouns['premises']} where the judge prefers "
                  "the model's reply to the base's (ties half), with a 95% bootstrap interval; LC win rate = the "
                  "same preference with the length effect regressed out (logistic fit of the win on the length "
                  "difference, read at equal length, as AlpacaEval's length-controlled win rate)."]
    judge_head = " reward (mean) | win rate vs base [95% CI] | LC win rate [95% CI] |" if rewards else ""
    fluent = any("perplexity" in r for r in results.values())  # with a fluency model (common/verdict.py)
    fluency_head = " perplexity | perplexity vs SFT |" if fluent else ""
    lines += ["*Cut*: the share of replies that the token cap stopped before the model ended them (the decoder's "
              "end token; n/a where the replies came from a run that did not record it); "
              "*looped*: a sentence or line of 5+ words, or a run of 8 words, said 3 or more times; "
              "*copied*: the share of a reply's "
              f"word 3-grams found in its {nouns['premise']} (mean over replies); distinct-2 over all replies; "
              "*refused*: the share of replies that decline (\"I'm sorry, but I can't\", \"As an AI\", ...: "
              "common/watch.py REFUSAL_PATTERNS); *conceded*: the share that tell the poster they are right "
              "(\"I agree\", \"you're right\", \"valid point\", ...: CONCESSION_PATTERNS); *off-topic*: the share "
              "of replies less related to their "
              f"{nouns['premise']} (tf-idf cosine) than 90% of the {nouns['references']} are (about 0.10 for "
              "those by construction)."]
    lines += ["", f"| model |{judge_head} BLEU-4 | ROUGE-1 | ROUGE-2 | ROUGE-L | words (mean) | cut | looped | copied | "
              f"distinct-2 | refused | conceded | off-topic |{fluency_head}",
              "| --- |" + (" --- | --- | --- |" if rewards else "") + " --- |" * 12 +
              (" --- | --- |" if fluent else "")]
    for name in names:
        r = results[name]
        judge = (f" {_fmt(r.get('reward_mean'))} | {_with_ci(r, 'win_rate_vs_base')} | "
                 f"{_with_ci(r, 'lc_win_rate_vs_base')} |") if rewards else ""
        lines.append(f"| {name} |{judge} {r['bleu4']:.2f} | {r['rouge1']:.3f} | {r['rouge2']:.3f} | "
                     f"{r['rougeL']:.3f} | {r['reply_words_mean']:.0f} | {_fmt(r.get('cut_share'), 2)} | "
                     f"{_fmt(r.get('looped_share'))} | "
                     f"{_fmt(r.get('premise_copy_share'))} | {_fmt(r.get('distinct_2'))} | {_fmt(r.get('refusal_share'))} | "
                     f"{_fmt(r.get('conceded_share'))} | {_fmt(r.get('off_topic_share'))} |" +
                     (f" {_fmt(r.get('perplexity'), 1)} | {_fmt(r.get('perplexity_vs_sft'), 2)} |" if fluent else ""))
    lines += sections or []
    if judge_verdict:
        lines += ["", "## The judge", "", f"From the reward run's judge_audit.json: {judge_verdict}"]
    if plots:
        lines += ["", "## Plots", ""]
        for caption, plot in plots.items():
            lines += [f"![{caption}]({Path(plot).name})", ""]
    lines += ["", "## Sample replies", ""]
    for i, premise in enumerate(premises[:n_samples]):
        text = display(premise)
        score = (lambda n: f" (reward {rewards[n][i]:.2f})") if rewards else (lambda n: "")
        lines += [f"### {i + 1}. {_cell(text.splitlines()[0] if text else premise['id'], 30)}", "",
                  f"> {_cell(text, 80)}", "",
                  "| " + " | ".join(f"{n}{score(n)}" for n in names) + f" | {nouns['reference']} |",
                  "| " + " | ".join("---" for _ in names) + " | --- |",
                  "| " + " | ".join(_cell(replies[n][i]) for n in names) + f" | {_cell(premise['chosen'])} |", ""]
    path.write_text("\n".join(lines) + "\n")
    return path
