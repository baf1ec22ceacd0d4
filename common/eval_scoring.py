"""Stage 05's scoring of every model's replies: the panel of judges (each a Scorer, common/scorers.py),
each reply's fluency, the metrics every task shares (overlap with the real replies, the replies'
shape), and each judge's reward and win rates against the base and SFT."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common import eval_inputs
from common.config import load_run_config
from common.data import load_split, n_words, read_json
from common.judges import CrossFitScorer, describe_judges
from common.metrics import judge_metrics, text_metrics
from common.model import resolve_model_path
from common.scorers import load_scorer
from common.verdict import fluency_figures, model_family
from common.watch import off_topic_shares, reply_shape


@dataclass
class JudgePanel:
    """The judges of one eval: what the report says of each (`info`, by name), the spec each is loaded by,
    and each one's fingerprint for the manifest."""
    info: dict = field(default_factory=dict)
    specs: dict = field(default_factory=dict)
    fingerprints: dict = field(default_factory=dict)
    crossfit: bool = False


def judge_panel(config, run, premises: list[dict], prompts: list[list[dict]]) -> JudgePanel:
    """--reward_run and --judge_runs, each refused when it trained on a scored premise and held out when it
    shares no post with the policy's train split either (common/judges.py); a cross-fit's k fold judges
    (--crossfit_judge_runs) as one more, each premise scored by the fold judge that never trained on its post."""
    runs = {Path(p).name: p for p in ([config.reward_run] if config.reward_run else []) + config.judge_runs}
    info = describe_judges(
        runs, Path(config.reward_run).name if config.reward_run else None, premises,
        {r["group_id"] for r in load_split(config.pairs_run, "train")} if config.judge_runs else set(),
        {name: load_run_config(path) for name, path in runs.items()}, eval_inputs.judges_trained_against(run))
    panel = JudgePanel(info, {name: f"run:{path}" for name, path in runs.items()},
                       {name: read_json(Path(path) / "manifest.json").get("judge") for name, path in runs.items()})
    if config.crossfit_judge_runs:
        crossfit = CrossFitScorer(config.crossfit_judge_runs, premises, prompts, config.pairs_run, taken=info)
        panel.info[crossfit.name], panel.specs[crossfit.name] = crossfit.info, crossfit.spec
        panel.fingerprints[crossfit.name], panel.crossfit = crossfit.fingerprints(), True
    return panel


def fluency_scores(config, run, prompts, replies: dict, candidates, human: list[str]) -> tuple[dict, list | None]:
    """Each reply's mean token log-probability under the frozen fluency model, by model, and best-of-n's
    candidates' (the fluency model's backends and family go into the manifest, with the figures of the
    `human` replies to the same premises: the yardstick a model's perplexity is read against)."""
    fluency = load_scorer(f"fluency:{resolve_model_path(config.fluency_model_name_or_path)}",
                          batch_size=config.batch_size)
    log_probs = {name: fluency.score(prompts, texts) for name, texts in replies.items()}
    yardstick = fluency_figures({**log_probs, "human": fluency.score(prompts, human)})["human"]
    run.manifest["fluency"] = {**fluency.backends, "policy_family": model_family(config.model_name_or_path),
                               "human_replies": yardstick}
    if not candidates:
        return log_probs, None
    # A candidate already scored (the greedy reply best_of_n_with_greedy adds; a sample equal to a model's
    # reply or to another sample) keeps that score: scored once, so the greedy reply meets its own bar exactly.
    known = {(i, text): lp for name, texts in replies.items() for i, (text, lp) in enumerate(zip(texts, log_probs[name]))}
    todo = list(dict.fromkeys((i, text) for i, group in enumerate(candidates) for text in group if (i, text) not in known))
    known.update(zip(todo, fluency.score([prompts[i] for i, _ in todo], [text for _, text in todo])))
    return log_probs, [[known[(i, text)] for text in group] for i, group in enumerate(candidates)]


def shared_metrics(task, premises: list[dict], replies: dict, speed: dict, log_probs: dict | None,
                   cut: dict | None = None) -> dict:
    """Every model's metrics that do not depend on the task or a judge: BLEU/ROUGE against the real replies,
    generation speed, reply words, the share cut at max_new_tokens (`cut`: model -> a flag a reply, where the
    decoder said), the replies' shape (loops, copying, variety, refusals, off-topic), fluency."""
    references = [task.references(r) for r in premises]
    shown = [task.display(p) for p in premises]
    off_topic = off_topic_shares(shown, references, replies)
    results = {name: {"n": len(texts), **text_metrics(texts, references), "generation": speed[name],
                      "reply_words_mean": sum(map(n_words, texts)) / max(1, len(texts)), **reply_shape(shown, texts),
                      "off_topic_share": off_topic[name]}
               for name, texts in replies.items()}
    for name, flags in (cut or {}).items():
        results[name]["cut_share"] = sum(flags) / max(1, len(flags))
    for name, figures in (fluency_figures(log_probs) if log_probs else {}).items():
        results[name].update(figures)
    return results


def judge_all(config, run, panel: JudgePanel, premises, prompts, replies: dict, results: dict) -> tuple[dict, dict]:
    """Each judge in turn (one in memory at a time) scores every reply: into each model's `by_judge`, its
    reward and win rates against the base (and, for a policy, against SFT), plain and length-controlled;
    the training judge's also at the top of each model's results. Returns (judge -> model -> scores, the
    training judge's model -> scores)."""
    words = {name: [n_words(t) for t in texts] for name, texts in replies.items()}
    every_judge, rewards = {}, {}
    for name, spec in panel.specs.items():
        judge = load_scorer(spec, batch_size=config.batch_size, packed=config.fast_paths, premises=premises,
                            prompts=prompts, pairs_run=config.pairs_run)
        run.manifest["backends"]["judge_scoring"][name] = judge.scoring
        scores = every_judge[name] = {model: judge.score(prompts, texts) for model, texts in replies.items()}
        del judge
        for model in replies:
            results[model].setdefault("by_judge", {})[name] = judge_metrics(
                scores[model], scores["base"], words[model], words["base"], config.seed)
            if "sft" in replies and model not in ("base", "sft"):  # what practice added to SFT
                results[model]["by_judge"][name].update(judge_metrics(
                    scores[model], scores["sft"], words[model], words["sft"], config.seed, against="sft"))
        if panel.info[name]["role"] == "training":
            rewards = scores
            for model in replies:
                results[model].update(results[model]["by_judge"][name])
    return every_judge, rewards


@dataclass
class Scores:
    """Everything stage 05 measured of the replies: each model's results (eval.json), and per reply what
    replies.jsonl shows (fluency, every judge's score, best-of-n's candidates' scores)."""
    results: dict = field(default_factory=dict)
    log_probs: dict | None = None  # model -> each reply's mean token log-prob (with a fluency model)
    candidate_lps: list | None = None  # best_of_n: each candidate's
    candidate_scores: list | None = None  # best_of_n: each candidate's score by its scorer
    passed: list | None = None  # best_of_n: each candidate passed the fluency gate (with one)
    every_judge: dict = field(default_factory=dict)  # judge -> model -> each reply's score
    rewards: dict = field(default_factory=dict)  # the training judge's: model -> each reply's score
