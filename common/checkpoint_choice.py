"""GRPO's final adapter chosen on held-out premises (stage 04's `checkpoint_eval_steps`).

The training judge's reward keeps rising while a policy games it; the step to keep is the one other
judges like best on premises it never practised on, provided its replies are still prose. Every
`checkpoint_eval_steps` steps the policy adapter is saved (steps/step-N, and step-0: where it
started); at the end each saved step writes greedy replies to the pairs run's dev premises, `dev_judges`
score them and the fluency scorer measures them, and the rule (`choose`) picks:

    the highest win rate against the start's replies (per premise, each dev judge's score of the step's
    reply against its score of the start's, ties half; the mean over the dev judges) among the steps whose
    mean fluency (token log-prob) is at most `fluency_tolerance` below the start's; the start itself
    (0.5) always qualifies, so a run whose every step lost fluency keeps the policy it started from. Ties
    go to the earlier step.

A win rate, not a mean score: judges of other families score on scales of their own (a pointwise MiniLM
judge's scores of every reply lay within 0.005 of each other in one run, a SmolLM2 judge's spread over
units), and a mean of their scores is the widest scale's choice.

The curve goes to metrics.json `checkpoint_choice` and checkpoints.png; a warning when every dev judge
is of the training judge's family (config.json `model_type`): such judges tend to share its blind spots.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from transformers import TrainerCallback

log = logging.getLogger("pipeline")

STEPS_DIR = "steps"


def choose(curve: list[dict], tolerance: float) -> int:
    """The chosen step of a curve of {"step", "win_rate_vs_start", "fluency"} rows (the start, step 0, first)."""
    start = curve[0]["fluency"]
    eligible = [c for c in curve if c is curve[0] or (not math.isnan(c["fluency"]) and
                                                    (math.isnan(start) or c["fluency"] >= start - tolerance))]
    return max(eligible, key=lambda c: (c["win_rate_vs_start"], -c["step"]))["step"]


def win_rate(scores: list[float], start: list[float]) -> float:
    """The share of premises whose reply a judge scores above the start's reply to it (ties half; a premise
    either reply could not be scored on is left out)."""
    import numpy as np

    from common.metrics import wins
    a, b = np.asarray(scores, float), np.asarray(start, float)
    kept = ~(np.isnan(a) | np.isnan(b))
    return float(wins(a[kept], b[kept]).mean()) if kept.any() else math.nan


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / STEPS_DIR / f"step-{step}"


def save_step(policy, run_dir: Path, step: int) -> None:
    """The policy adapter alone (not TRL's "ref" copy of the starting one); one writer in a launch."""
    from common.runs import is_main_process
    if is_main_process():
        policy.save_pretrained(step_dir(run_dir, step), selected_adapters=["default"])


class SaveEvery(TrainerCallback):
    """Saves the policy adapter every `every` optimiser steps into steps/step-N."""

    def __init__(self, every: int, run_dir: Path, policy):
        self.every, self.run_dir, self.policy = every, run_dir, policy

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and state.global_step % self.every == 0:
            save_step(self.policy, self.run_dir, state.global_step)
        return control


def saved_steps(run_dir: Path) -> list[int]:
    folder = Path(run_dir) / STEPS_DIR
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*")) if folder.is_dir() else []


def family(spec: str | None) -> str | None:
    """The family of the judge a scorer spec names, as the verdict reads it ("features" for the feature judge, a
    backbone's model_type, an ensemble's members' joined by '+'); None for a function."""
    from common.verdict import scorer_families
    return "+".join(sorted(scorer_families(spec))) or None


def load_step(policy, run_dir: Path, step: int) -> None:
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    set_peft_model_state_dict(policy, load_peft_weights(str(step_dir(run_dir, step))), adapter_name="default")


def evaluate(config, run, policy, tokenizer, training_judge) -> dict:
    """Each saved step's dev replies scored; the chosen step's weights loaded into `policy` (the caller
    saves it as adapter/). Returns metrics.json's `checkpoint_choice`."""
    from common.data import fit_prompt, load_split, one_per_group
    from common.fluency import FluencyScorer
    from common.generation import replies_and_cuts
    from common.model import resolve_model_path
    from common.scorers import load_scorer
    rows = one_per_group(load_split(run.pairs_run, "dev"))[: config.checkpoint_eval_premises]
    prompts = [fit_prompt(tokenizer, r["prompt"], config.max_prompt_tokens) for r in rows]
    judges = [training_judge if spec == "judge" else
              load_scorer(spec, batch_size=config.reward_batch_size, packed=config.fast_paths)
              for spec in config.dev_judges]
    fluency = FluencyScorer(resolve_model_path(config.fluency_model_name_or_path),
                            batch_size=config.reward_batch_size, max_tokens=config.max_completion_length)
    decoding = {"repetition_penalty": config.checkpoint_repetition_penalty, "temperature": config.checkpoint_temperature,
                "no_repeat_ngram_size": config.checkpoint_no_repeat_ngram_size, "seed": config.seed}
    curve, scored = [], []
    for step in saved_steps(run.dir):
        load_step(policy, run.dir, step)
        replies, cut = replies_and_cuts(policy, tokenizer, prompts, config.max_completion_length,
                                        config.rollout_batch_size, weights=config.rollout_weights,
                                        static=config.fast_paths and config.rollout_backend == "static", **decoding)
        scored.append({f"{j.name}" if j is not training_judge else "judge": j.score(prompts, replies) for j in judges})
        by_judge = {name: _mean(scores) for name, scores in scored[-1].items()}
        wins = {name: win_rate(scores, scored[0][name]) for name, scores in scored[-1].items()}
        curve.append({"step": step, "judges": by_judge, "win_rates_vs_start": wins,
                      "win_rate_vs_start": _mean(list(wins.values())),
                      "fluency": _mean(fluency.score(prompts, replies)),
                      # what the guard and the cap see: a drop in length that is the policy learning to finish
                      "reply_words_mean": _mean([len(r.split()) for r in replies]), "cut_share": _mean(cut)})
        log.info("checkpoint step %d on %d dev premises: win rates vs the start %s, fluency %.3f, %.0f words, "
                 "%.0f%% cut at the cap", step, len(prompts), wins, curve[-1]["fluency"], curve[-1]["reply_words_mean"],
                 100 * curve[-1]["cut_share"])
    chosen = choose(curve, config.fluency_tolerance)
    load_step(policy, run.dir, chosen)
    policy.train()
    trained = family(config.reward_run)
    families = [trained if spec == "judge" else family(spec) for spec in config.dev_judges]
    warning = (f"every dev judge is of the training judge's family ({trained}): they may share its blind spots"
               if trained and all(f == trained for f in families) else None)
    if warning:
        log.warning("checkpoint choice: %s", warning)
    plot = plot_curve(run.dir, curve, chosen)
    return {"chosen_step": chosen, "premises": len(prompts), "dev_judges": list(config.dev_judges),
            "dev_judge_families": families, "training_judge_family": trained, "warning": warning,
            "decoding": decoding, "max_new_tokens": config.max_completion_length,
            "fluency_model": config.fluency_model_name_or_path, "fluency_tolerance": config.fluency_tolerance,
            "rule": "highest win rate against the start's replies (step 0; the mean over the dev judges) among "
                    "steps whose fluency is at most fluency_tolerance below the start's; ties to the earlier step",
            "curve": curve, "plot": plot.name}


def _mean(values) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def plot_curve(out_dir: Path, curve: list[dict], chosen: int) -> Path:
    """checkpoints.png: the dev judges' win rate against the start and the fluency per saved step, the chosen
    one marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from common.report import save_figure
    steps = [c["step"] for c in curve]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for ax, key, title in ((axes[0], "win_rate_vs_start", "dev judges' win rate vs the start"),
                           (axes[1], "fluency", "fluency (mean token log-prob)")):
        ax.plot(steps, [c[key] for c in curve], marker=".")
        ax.axvline(chosen, color="grey", linestyle="--", label=f"chosen: step {chosen}")
        ax.set_title(title)
        ax.set_xlabel("step")
    axes[0].legend()
    path = save_figure(fig, Path(out_dir) / "checkpoints.png")
    return path
