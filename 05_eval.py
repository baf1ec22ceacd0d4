"""Stage 05: score held-out premises (CMV posts or papers) with the base model and each adapter given.

    python 05_eval.py --config configs/smol/05_eval.yaml --pairs_run runs/Nov30_Pairs_Run1 \
        --reward_run runs/Nov30_Reward_Run1 --sft_run runs/Nov30_SFT_Run1 --policy_runs runs/Nov30_GRPO_Run1
    python 05_eval.py --config configs/smol/review/05_eval.yaml --pairs_run runs/Dec01_Pairs_Run2 \
        --sft_run runs/Dec01_SFT_Run2 --policy_runs runs/Dec01_DPO_Run1

For each premise of the held-out split (one per original post or paper), every model writes a
reply to the prompt cut to `max_prompt_tokens` (for a paper: its head, the first window; report.md
says so): greedy, or as the decoding fields say (`repetition_penalty`, `no_repeat_ngram_size`,
`temperature` with `seed`). A review without a parseable rating still gets the model's own: its
next-token distribution over the scale after the review and the rating header (common/readout.py;
`reading: all_windows` reads it on every window of the paper and averages). Replies are compared
with the real ones (BLEU-4, ROUGE-1/2/L; against every real review of a paper). With a
`--reward_run`, the stage-03 judge scores every reply, and each adapter's win rate against the base
(and against SFT) comes with a 95% bootstrap interval, and so does its length-controlled win rate (the judge's length effect regressed out, as in AlpacaEval). With
`--judge_runs`, more judges score the same replies, each reported under its run name (eval.json
`judges` and each model's `by_judge`, a table in report.md); a judge that trained on any scored
premise is refused, and the report says when a model gains under its training judge (--reward_run)
but not under a held-out one (common/judges.py). With `fluency_model_name_or_path`, every reply's
mean token log-probability under that frozen LM gives each model's perplexity (and its ratio to
SFT's); a model's gain holds only under held-out judges of two families and that fluency gate
(eval.json `verdict`, report.md's first lines; common/verdict.py). The task
adds its own metrics (review: the rating parsed from each review against the reviewers' mean, with
a constant and a human baseline). Writes eval.json, replies.jsonl, histograms (PNG, also to W&B)
and a readable report.md.

Other inputs (common/eval_inputs.py): `--eval_data FILE...` scores rows of the task's source format
instead of the test split, read as stage 01 reads them (a row whose post or paper is in the pairs
run's train or dev split is refused, or dropped with `--skip_overlap true`); `--replies_from EVAL_RUN`
scores that finished run's replies again with the judges given, generating nothing.

    python 05_eval.py --config configs/smol/review/05_eval.yaml --pairs_run runs/Dec01_Pairs_Run2 \
        --sft_run runs/Dec01_SFT_Run2 --eval_data other_papers.jsonl.gz
    python 05_eval.py --config configs/smol/05_eval.yaml --replies_from runs/Nov30_Eval_Run1 \
        --judge_runs runs/Nov30_Reward_Run3
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from transformers import set_seed

from common import best_of_n, eval_inputs, fast
from common.cli import cli
from common.config import EvalConfig
from common.data import DataError, fit_prompt, load_split, one_per_group, read_json, write_json, write_jsonl
from common.eval_outputs import describe_decoding, headline, kept_step, reply_rows, report_sections
from common.eval_scoring import JudgePanel, Scores, fluency_scores, judge_all, judge_panel, shared_metrics
from common.generation import adapter_on, decoder_backends, in_groups, replies_of
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.rating_sources import hinted_premises, rating_inputs, rerank_by_rating
from common.readout import rating_readouts
from common.report import log_plots_to_wandb, plot_distributions, plot_watch, write_report
from common.runs import Run
from common.tasks import get_task
from common.tasks.protocol import EvalReport
from common.verdict import decide

log = logging.getLogger("pipeline")


def main(config: EvalConfig, overrides: dict) -> None:
    # 1. Seed, run directory, inputs (all finished, all on this base, all descended from --pairs_run:
    #    the held-out premises below were never trained on; other judges, --judge_runs, may come from
    #    another pairs run of the task).
    config = eval_inputs.source_settings(config, overrides)  # --replies_from: that run's premises and decoding
    set_seed(config.seed)
    run = Run("Eval", config, overrides, inputs=run_inputs(config), base=fingerprint(config))
    task = get_task(run.task)
    adapters = model_adapters(run)  # model name in the report (sft, grpo, dpo, ...) -> adapter folder
    other_sft = eval_inputs.other_sft_starts(run, adapters)  # policies whose "vs SFT" is not against their start
    run.start_tracking()

    # 2. Held-out premises: one per original post or paper, with its real replies as references.
    tokenizer = load_tokenizer(config)
    premises = held_out_premises(config, task, run)
    # 2b. Review: the rating model's rating of each paper (--rating_run; it must not have trained on one), and
    #     the dev run whose ratings fit the blend (--rating_dev_run), checked before anything is generated; a
    #     writer trained with a rating in its prompt gets the rating model's there (common/rating_sources.py).
    rating = rating_inputs(config, run, premises) if config.rating_run or config.rating_dev_run else None
    premises = hinted_premises(config, run, premises, rating)
    prompts = [fit_prompt(tokenizer, r["prompt"], config.max_prompt_tokens) for r in premises]
    log.info("evaluating %s on %d premises", ["base"] * config.evaluate_base + [*adapters], len(premises))

    # 2c. The judges, before anything is generated: none may have trained on a scored premise; a judge
    #     that also shares no post with the policy's train split is held out; a cross-fit is one more
    #     judge (common/eval_scoring.py, common/judges.py).
    panel = judge_panel(config, run, premises, prompts)

    # 3. Generate every model's replies (or read them back with --replies_from).
    made = generate_all(config, run, task, tokenizer, adapters, premises, prompts, rating)

    # 4. Score: fluency, best-of-n's pick, the shared metrics and every judge; then the task's own
    #    metrics (review: ratings, baselines), which read the replies and write into nothing.
    scores = score_all(config, run, task, premises, prompts, made, panel, other_sft)
    report = task.evaluate(premises, made.replies, train=load_split(config.pairs_run, "train"),
                           readouts=made.readouts, rating=rating, seed=config.seed)
    for name, metrics in report.metrics.items():
        scores.results[name].update(metrics)
    for name in scores.results:
        log.info("%s: %s", name, scores.results[name])

    # 5. Write eval.json, every reply with its scores, the plots and the report; mark done.
    write_outputs(config, run, task, premises, adapters, made, scores, report, panel, other_sft)


@dataclass
class Generated:
    """Every model's replies to the premises, in premise order, and what came with them."""
    replies: dict = field(default_factory=dict)  # model -> replies
    readouts: dict = field(default_factory=dict)  # model -> ratings read out (tasks with a READOUT_SCALE)
    speed: dict = field(default_factory=dict)  # model -> generation_speed
    cut: dict = field(default_factory=dict)  # model -> whether each reply was cut at max_new_tokens
    windows: list | bool | None = None  # reading all_windows: each premise's windows (read back: whether read)
    candidates: list | None = None  # best_of_n: n sampled replies a premise
    candidate_cut: list | None = None  # and whether each was cut


def run_inputs(config: EvalConfig) -> dict:
    """Every input of the run by field, as Run checks and records them."""
    inputs = {"pairs_run": config.pairs_run, "reward_run": config.reward_run, "sft_run": config.sft_run,
              **{f"policy_runs[{i}]": path for i, path in enumerate(config.policy_runs)},
              **{f"judge_runs[{i}]": path for i, path in enumerate(config.judge_runs)},
              **{f"crossfit_judge_runs[{i}]": path for i, path in enumerate(config.crossfit_judge_runs)},
              "rating_run": config.rating_run, "rating_dev_run": config.rating_dev_run,  # review: ratings
              **eval_inputs.input_files(config)}  # --eval_data files (with their sha256), --replies_from
    return {k: v for k, v in inputs.items() if v}


def held_out_premises(config: EvalConfig, task, run: Run) -> list[dict]:
    """The split's premises, one per post or paper; or --eval_data's, none of the train or dev split's
    (common/eval_inputs.py)."""
    premises = one_per_group(load_split(config.pairs_run, config.split))[: config.max_premises]
    if config.eval_data:
        premises, run.manifest["eval_data"] = eval_inputs.premises_from_files(config, task, run)
    if not premises:
        raise DataError(f"{config.pairs_run}: its {config.split} split holds no premises to score")
    return premises


def generate_all(config: EvalConfig, run: Run, task, tokenizer, adapters: dict, premises: list[dict],
                 prompts: list, rating: dict | None) -> Generated:
    """The base with adapters disabled, then each adapter on the same 4-bit base. Review: each model's own
    rating is also read after its review (common/readout.py), so that a review that never wrote one still
    has a rating; reading all_windows reads it on every window too. Then best-of-n's candidates (n sampled
    replies a premise from the SFT model, the base without one) and review's rerank_by_rating."""
    if config.replies_from:  # nothing generated: that run's replies, read back (common/eval_inputs.py)
        replies, readouts, speed, cut = eval_inputs.read_replies(run, premises, task)
        return Generated(replies, readouts, speed, cut, bool(task.READOUT_SCALE) and config.reading == "all_windows")
    names = list(adapters)
    model = load_model(config, CAUSAL_LM, adapter=adapters[names[0]], trainable=False,
                       adapter_name=names[0]) if names else load_model(config, CAUSAL_LM, trainable=False)
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False)
    run.manifest["decoding"] = config.decoding()
    run.manifest["backends"] = fast.backends(config, [], **decoder_backends(model, config.fast_paths,
                                                                             config.generation_weights), judge_scoring={})
    windows = [task.reading_windows(p, tokenizer, config.max_prompt_tokens, config.window_overlap) for p in premises] \
        if task.READOUT_SCALE and config.reading == "all_windows" else None
    made = Generated(windows=windows)
    for name in (["base"] if config.evaluate_base else []) + names:
        with adapter_on(model, name):
            made.replies[name], made.cut[name], made.speed[name] = replies_of(model, tokenizer, prompts, config)
            if task.READOUT_SCALE:
                made.readouts[name] = rating_readouts(model, tokenizer, task, prompts, made.replies[name], windows)
    if config.best_of_n:
        source = "sft" if "sft" in adapters else "base"
        run.manifest["best_of_n"] = {"n": config.best_of_n, "from": source, "temperature": config.best_of_n_temperature}
        with adapter_on(model, source):
            flat, cut, made.speed["best_of_n"] = replies_of(model, tokenizer, prompts, config, config.best_of_n,
                                                            config.best_of_n_temperature)
        made.candidates, made.candidate_cut = in_groups(flat, config.best_of_n), in_groups(cut, config.best_of_n)
        if config.best_of_n_with_greedy:  # the source's greedy reply first: it passes the fluency gate by its bar
            made.candidates = [[greedy, *group] for greedy, group in zip(made.replies[source], made.candidates)]
            made.candidate_cut = [[greedy, *group] for greedy, group in zip(made.cut[source], made.candidate_cut)]
            run.manifest["best_of_n"]["with_greedy"] = True
    if config.rerank_by_rating:  # n sampled SFT reviews a paper, the one nearest the rating model's rating kept
        run.manifest["rerank_by_rating"] = {"n": config.rerank_by_rating, "from": "sft",
                                            "temperature": config.rerank_temperature}
        with adapter_on(model, "sft"):
            sampled, cut, made.speed["rerank_by_rating"] = replies_of(model, tokenizer, prompts, config,
                                                                      config.rerank_by_rating, config.rerank_temperature)
            made.replies["rerank_by_rating"], rating["reranked"] = rerank_by_rating(sampled, config.rerank_by_rating,
                                                                                    rating["rating_model"])
            made.cut["rerank_by_rating"] = [cut[i * config.rerank_by_rating + kept["kept"]]
                                            for i, kept in enumerate(rating["reranked"])]
            made.readouts["rerank_by_rating"] = rating_readouts(model, tokenizer, task, prompts,
                                                                made.replies["rerank_by_rating"], windows)
    del model
    return made


def score_all(config: EvalConfig, run: Run, task, premises: list[dict], prompts: list, made: Generated,
              panel: JudgePanel, other_sft: dict) -> Scores:
    """Fluency first (common/verdict.py: each reply's mean token log-probability under a frozen LM of another
    family, and best-of-n's candidates', so that its pick can be gated on it); best-of-n's pick, added to the
    replies (common/best_of_n.py); the metrics every task shares; then each judge, one at a time, each a
    Scorer (common/scorers.py: a run, an ensemble, a cross-fit): reward and win rates against the base and
    SFT, plain and length-controlled (common/eval_scoring.py)."""
    scores = Scores()
    if config.fluency_model_name_or_path:
        human = [(task.references(row) or [""])[0] for row in premises]  # the first real reply: CMV's winner
        scores.log_probs, scores.candidate_lps = fluency_scores(config, run, prompts, made.replies, made.candidates,
                                                                human)
    if made.candidates:
        made.replies["best_of_n"], scores.candidate_scores, scores.passed = best_of_n.pick(
            config, run.manifest, prompts, made.candidates, scores.log_probs, scores.candidate_lps)
        picked = [c.index(best) for c, best in zip(made.candidates, made.replies["best_of_n"])]
        if scores.log_probs is not None:
            scores.log_probs["best_of_n"] = [lps[i] for lps, i in zip(scores.candidate_lps, picked)]
        if made.candidate_cut:
            made.cut["best_of_n"] = [cut[i] for cut, i in zip(made.candidate_cut, picked)]
    scores.results = shared_metrics(task, premises, made.replies, made.speed, scores.log_probs, made.cut)
    for model, their in other_sft.items():
        scores.results[model]["vs_sft_started_from"] = their
        log.warning("%s started from SFT run %s, not --sft_run %s: its vs-SFT numbers compare it with another "
                    "model", model, their, config.sft_run)
    scores.every_judge, scores.rewards = judge_all(config, run, panel, premises, prompts, made.replies, scores.results)
    if config.reward_run:
        run.manifest["judge"] = run.inputs["reward_run"].get("judge")
    run.manifest["judges"] = panel.fingerprints
    run.save_manifest()
    return scores


def write_outputs(config: EvalConfig, run: Run, task, premises: list[dict], adapters: dict, made: Generated,
                  scores: Scores, report: EvalReport, panel: JudgePanel, other_sft: dict) -> None:
    """eval.json (with each model's verdict: a gain holds under held-out judges of two families and the
    fluency gate, common/verdict.py), replies.jsonl, the plots and report.md; then DONE. A CUDA graph that
    could not be captured fell back to eager decoding steps (slower, the same tokens): recorded."""
    run.manifest["backends"]["decoder_fallbacks"] = list(fast.GRAPH_FAILURES)
    results, judges = scores.results, panel.info
    metrics = {name: read_json(path.parent / "metrics.json") for name, path in adapters.items()}
    for name, path in adapters.items():  # which run each model's adapter came from (grpo, grpo2, ... by name)
        if name in results:
            results[name]["run"] = path.parent.name
            if kept := kept_step(metrics[name]):  # a GRPO adapter chosen on dev: which step
                results[name]["checkpoint_kept"] = kept
    # a held-out judge of a family a model practised against does not count for it
    practised = eval_inputs.practised_against(run, adapters, judges, (run.manifest.get("best_of_n") or {}).get(
        "scorer") if "best_of_n" in results else None)
    for name, decided in (decide(results, judges, config, scores.log_probs is not None, practised)
                          if judges else {}).items():
        results[name]["verdict"] = decided
    judge_info = {"judges": judges} if judges else {}
    write_json(run.dir / "eval.json", {**results, **report.baselines, **judge_info})
    write_jsonl(run.dir / "replies.jsonl", reply_rows(task, premises, made.replies, scores, made.candidates,
                                                      report.per_reply, made.cut, made.candidate_cut))
    grpo = {name: metrics[name].get("per_step") for name, path in adapters.items()
            if read_json(path.parent / "manifest.json").get("stage") == "GRPO"}
    plots = {**plot_distributions(run.dir, made.replies, scores.rewards, task.NOUNS["premises"]),
             **plot_watch(run.dir, grpo), **report.plots(run.dir)}
    log_plots_to_wandb(plots)
    audit = Path(config.reward_run or "") / "judge_audit.json"
    verdict = read_json(audit)["verdict"]["text"] if config.reward_run and audit.is_file() else None
    opening = headline(config, run.manifest, results, judges, scores.log_probs is not None)  # the report opens with it
    written = write_report(run.dir / "report.md", run.dir.name, results, premises, made.replies, scores.rewards,
                           config.n_report_samples, plots, verdict,
                           report_sections(config, run.manifest, task, results, judges, report.sections, other_sft,
                                           panel.crossfit),
                           reading=f"the prompt cut to {config.max_prompt_tokens} tokens ({task.READING})" +
                           ("; the rating is also read on every window" if made.windows else ""),
                           decoding=describe_decoding(config, run.manifest), display=task.display, nouns=task.NOUNS,
                           headline=opening)
    run.finish({"verdict": opening, "models": results, **report.baselines, **judge_info,
                "n_premises": len(premises), "report": str(written)})
    print(f"report: {written.resolve()}")


def model_adapters(run) -> dict[str, Path]:
    """sft, then each policy under its stage's name (grpo, dpo, orpo; grpo_from_base for one that started on the
    base; raft for an SFT run on best-of-n picks, --targets_from, raft_greedy where the greedy reply was a
    candidate; a second of a kind gets a number)."""
    adapters = {}
    if run.config.sft_run:
        adapters["sft"] = Path(run.config.sft_run) / "adapter"
    for i, path in enumerate(run.config.policy_runs):
        recorded = run.inputs[f"policy_runs[{i}]"]
        targets = recorded.get("targets_from")
        name = ("raft_greedy" if targets.get("with_greedy") else "raft") if targets else \
            recorded["stage"].lower() + ("_from_base" if recorded.get("started_from") == "base" else "")
        name = name if name not in adapters else f"{name}{i + 1}"
        adapters[name] = Path(path) / "adapter"
    return adapters


if __name__ == "__main__":
    cli(main, EvalConfig, __doc__)
