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

import contextlib
import logging
import math
import time
from pathlib import Path

from transformers import set_seed

from common import eval_inputs, fast
from common.best_of_n import fluency_gate, keep_best
from common.cli import cli
from common.config import ConfigError, EvalConfig, load_run_config
from common.data import DataError, fit_prompt, load_split, n_words, one_per_group, read_json, write_json, write_jsonl
from common.generation import decoder_backends, generate_replies
from common.judges import CrossFitScorer, describe_judges, gain_lines, load_judge
from common.metrics import judge_metrics, text_metrics
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer, resolve_model_path
from common.rating_sources import rating_inputs, rerank_by_rating
from common.readout import rating_readouts
from common.report import judges_section, log_plots_to_wandb, plot_distributions, plot_watch, write_report
from common.runs import Run
from common.scorers import ScorerError, load_scorer
from common.tasks import get_task
from common.verdict import decide, family_lines, fluency_figures, fluency_model_line, model_family, verdict_lines
from common.watch import reply_shape

log = logging.getLogger("pipeline")


def main(config: EvalConfig, overrides: dict) -> None:
    # 1. Seed, run directory, inputs (all finished, all on this base, all descended from --pairs_run:
    #    the held-out premises below were never trained on; other judges, --judge_runs, may come from
    #    another pairs run of the task).
    config = eval_inputs.source_settings(config, overrides)  # --replies_from: that run's premises and decoding
    set_seed(config.seed)
    inputs = {"pairs_run": config.pairs_run, "reward_run": config.reward_run, "sft_run": config.sft_run,
              **{f"policy_runs[{i}]": path for i, path in enumerate(config.policy_runs)},
              **{f"judge_runs[{i}]": path for i, path in enumerate(config.judge_runs)},
              **{f"crossfit_judge_runs[{i}]": path for i, path in enumerate(config.crossfit_judge_runs)},
              "rating_run": config.rating_run, "rating_dev_run": config.rating_dev_run,  # review: ratings
              **eval_inputs.input_files(config)}  # --eval_data files (with their sha256), --replies_from
    run = Run("Eval", config, overrides, inputs={k: v for k, v in inputs.items() if v}, base=fingerprint(config))
    task = get_task(run.task)
    adapters = model_adapters(run)  # model name in the report (sft, grpo, dpo, ...) -> adapter folder
    other_sft = eval_inputs.other_sft_starts(run, adapters)  # policies whose "vs SFT" is not against their start
    run.start_tracking()

    # 2. Held-out premises: one per original post or paper, with its real replies as references.
    tokenizer = load_tokenizer(config)
    premises = one_per_group(load_split(config.pairs_run, config.split))[: config.max_premises]
    if config.eval_data:  # other posts or papers instead, none of the train or dev split's (common/eval_inputs.py)
        premises, run.manifest["eval_data"] = eval_inputs.premises_from_files(config, task, run)
    if not premises:
        raise DataError(f"{config.pairs_run}: its {config.split} split holds no premises to score")
    prompts = [fit_prompt(tokenizer, r["prompt"], config.max_prompt_tokens) for r in premises]
    references = [task.references(r) for r in premises]
    log.info("evaluating %s on %d premises", ["base", *adapters], len(premises))

    # 2b. The judges, before anything is generated: none may have trained on a scored premise; a judge
    #     that also shares no post with the policy's train split is held out (common/judges.py).
    judge_runs = {Path(p).name: p for p in ([config.reward_run] if config.reward_run else []) + config.judge_runs}
    judges = describe_judges(
        judge_runs, Path(config.reward_run).name if config.reward_run else None, premises,
        {r["group_id"] for r in load_split(config.pairs_run, "train")} if config.judge_runs else set(),
        {name: load_run_config(path) for name, path in judge_runs.items()}, eval_inputs.judges_trained_against(run))
    # 2c. A cross-fit's k fold judges (--crossfit_judge_runs) as one judge: each premise is scored by the
    #     fold judge that never trained on its post (common/judges.py CrossFitScorer).
    crossfit = CrossFitScorer(config.crossfit_judge_runs, premises, prompts, config.pairs_run, taken=judges) \
        if config.crossfit_judge_runs else None
    if crossfit:
        judges[crossfit.name] = crossfit.info

    # 2d. Review: the rating model's rating of each paper (--rating_run; it must not have trained on one), and
    #     the dev run whose ratings fit the blend (--rating_dev_run), checked before anything is generated
    #     (common/rating_sources.py).
    rating = rating_inputs(config, run, premises) if config.rating_run or config.rating_dev_run else None

    # 3. Generate: the base with adapters disabled, then each adapter on the same 4-bit base. Review:
    #    each model's own rating is also read after its review (common/readout.py), so that a review
    #    that never wrote one still has a rating; reading all_windows reads it on every window too.
    replies, readouts, speed = {}, {}, {}
    names = list(adapters)
    candidates = None
    if config.replies_from:  # nothing generated: that run's replies, read back (common/eval_inputs.py)
        replies, readouts, speed = eval_inputs.read_replies(run, premises, task)
        windows = bool(task.READOUT_SCALE) and config.reading == "all_windows"
    else:
        model = load_model(config, CAUSAL_LM, adapter=adapters[names[0]], trainable=False,
                           adapter_name=names[0]) if names else load_model(config, CAUSAL_LM, trainable=False)
        for name in names[1:]:
            model.load_adapter(str(adapters[name]), adapter_name=name, is_trainable=False, autocast_adapter_dtype=False)
        run.manifest["decoding"] = config.decoding()
        run.manifest["backends"] = fast.backends(config, [], **decoder_backends(model, config.fast_paths,
                                                                                 config.generation_weights), judge_scoring={})
        windows = [task.reading_windows(p, tokenizer, config.max_prompt_tokens, config.window_overlap) for p in premises] \
            if task.READOUT_SCALE and config.reading == "all_windows" else None
        for name in (["base"] if config.evaluate_base else []) + names:
            if name != "base":
                model.set_adapter(name)
            with model.disable_adapter() if name == "base" else contextlib.nullcontext():
                started = time.perf_counter()
                replies[name] = generate_replies(model, tokenizer, prompts, config.max_new_tokens, config.batch_size,
                                                 **config.decoding())
                speed[name] = generation_speed(tokenizer, replies[name], time.perf_counter() - started)
                if task.READOUT_SCALE:
                    readouts[name] = rating_readouts(model, tokenizer, task, prompts, replies[name], windows)
        #    Best-of-n's candidates: n sampled replies a premise from the SFT model (the base without one).
        if config.best_of_n:
            source = "sft" if "sft" in adapters else "base"
            run.manifest["best_of_n"] = {"n": config.best_of_n, "from": source, "temperature": config.best_of_n_temperature}
            if source == "sft":
                model.set_adapter("sft")
            with model.disable_adapter() if source == "base" else contextlib.nullcontext():
                started = time.perf_counter()
                flat = generate_replies(model, tokenizer, [p for p in prompts for _ in range(config.best_of_n)],
                                        config.max_new_tokens, config.batch_size,
                                        **{**config.decoding(), "temperature": config.best_of_n_temperature})
                speed["best_of_n"] = generation_speed(tokenizer, flat, time.perf_counter() - started)
            candidates = [flat[i:i + config.best_of_n] for i in range(0, len(flat), config.best_of_n)]
        #    Review, rerank_by_rating: n sampled SFT reviews a paper, the one whose written rating is nearest the
        #    rating model's kept (common/rating_sources.py), its rating read out like every model's.
        if config.rerank_by_rating:
            run.manifest["rerank_by_rating"] = {"n": config.rerank_by_rating, "from": "sft",
                                                "temperature": config.rerank_temperature}
            model.set_adapter("sft")
            started = time.perf_counter()
            sampled = generate_replies(model, tokenizer, [p for p in prompts for _ in range(config.rerank_by_rating)],
                                       config.max_new_tokens, config.batch_size,
                                       **{**config.decoding(), "temperature": config.rerank_temperature})
            speed["rerank_by_rating"] = generation_speed(tokenizer, sampled, time.perf_counter() - started)
            replies["rerank_by_rating"], rating["reranked"] = rerank_by_rating(sampled, config.rerank_by_rating,
                                                                               rating["rating_model"])
            readouts["rerank_by_rating"] = rating_readouts(model, tokenizer, task, prompts, replies["rerank_by_rating"],
                                                           windows)
        del model

    # 4. Score: best-of-n's pick (best_of_n_scorer's, the training judge by default); overlap with the real replies; what the replies
    #    look like (loops, copying from the premise, variety); each judge: reward, win rates against the
    #    base and SFT (plain and length-controlled); the task's own metrics (review: ratings, baselines).
    #    Fluency first (common/verdict.py): each reply's mean token log-probability under a frozen LM of
    #    another family, and best-of-n's candidates', so that its pick can be gated on it.
    candidate_scores = log_probs = candidate_lps = passed = None
    if config.fluency_model_name_or_path:
        fluency = load_scorer(f"fluency:{resolve_model_path(config.fluency_model_name_or_path)}",
                              batch_size=config.batch_size)
        run.manifest["fluency"] = {**fluency.backends, "policy_family": model_family(config.model_name_or_path)}
        log_probs = {name: fluency.score(prompts, texts) for name, texts in replies.items()}
        if candidates:
            flat = fluency.score([p for p, c in zip(prompts, candidates) for _ in c], [t for c in candidates for t in c])
            candidate_lps = [flat[i:i + config.best_of_n] for i in range(0, len(flat), config.best_of_n)]
        del fluency
    if candidates:  # the scorer's favourite among the candidates that pass the fluency gate (common/best_of_n.py)
        source = run.manifest["best_of_n"]["from"]
        try:
            judge = load_scorer(config.best_of_n_scorer, batch_size=config.batch_size, packed=config.fast_paths) \
                if config.best_of_n_scorer else load_judge(config.reward_run, batch_size=config.batch_size,
                                                           packed=config.fast_paths)
        except ScorerError as err:
            raise ConfigError(f"field 'best_of_n_scorer': {err}", "best_of_n_scorer") from None
        if candidate_lps and source in log_probs:
            passed = fluency_gate(candidate_lps, log_probs[source], config.best_of_n_fluency_margin)
        run.manifest["best_of_n"].update(
            scorer=config.best_of_n_scorer or f"run:{config.reward_run}",
            fluency_gate=f"mean log-prob >= {source}'s greedy reply's - {config.best_of_n_fluency_margin:g}"
            if passed else "none (no fluency model, or no greedy reply of its source)",
            passed_share=sum(map(sum, passed)) / sum(map(len, passed)) if passed else None)
        replies["best_of_n"], candidate_scores = keep_best(prompts, candidates, judge.score, passed, candidate_lps)
        del judge
        if log_probs is not None:
            log_probs["best_of_n"] = [lps[c.index(best)] for lps, c, best in
                                      zip(candidate_lps, candidates, replies["best_of_n"])]
    words = {name: [n_words(t) for t in texts] for name, texts in replies.items()}
    shown = [task.display(p) for p in premises]
    results = {name: {"n": len(texts), **text_metrics(texts, references), "generation": speed[name],
                      "reply_words_mean": sum(words[name]) / max(1, len(texts)), **reply_shape(shown, texts)}
               for name, texts in replies.items()}
    for name, figures in (fluency_figures(log_probs) if log_probs else {}).items():
        results[name].update(figures)
    for model, their in other_sft.items():
        results[model]["vs_sft_started_from"] = their
        log.warning("%s started from SFT run %s, not --sft_run %s: its vs-SFT numbers compare it with another "
                    "model", model, their, config.sft_run)
    rewards, verdict = {}, None  # rewards: the training judge's (replies.jsonl, plots)
    every_judge = {}  # judge -> model -> score of each reply (replies.jsonl)
    for name, path in {**judge_runs, **({crossfit.name: crossfit} if crossfit else {})}.items():  # one at a time
        judge = load_judge(path, batch_size=config.batch_size, packed=config.fast_paths)
        run.manifest["backends"]["judge_scoring"][name] = judge.scoring
        scores = every_judge[name] = {model: judge.score(prompts, texts) for model, texts in replies.items()}
        del judge
        for model in replies:
            results[model].setdefault("by_judge", {})[name] = judge_metrics(
                scores[model], scores["base"], words[model], words["base"], config.seed)
            if "sft" in replies and model not in ("base", "sft"):  # what practice added to SFT
                results[model]["by_judge"][name].update(judge_metrics(
                    scores[model], scores["sft"], words[model], words["sft"], config.seed, against="sft"))
        if judges[name]["role"] == "training":
            rewards = scores
            for model in replies:
                results[model].update(results[model]["by_judge"][name])
    if config.reward_run:
        run.manifest["judge"] = run.inputs["reward_run"].get("judge")
        audit = Path(config.reward_run) / "judge_audit.json"
        verdict = read_json(audit)["verdict"]["text"] if audit.is_file() else None
    run.manifest["judges"] = {name: read_json(Path(path) / "manifest.json").get("judge")
                              for name, path in judge_runs.items()}
    if crossfit:
        run.manifest["judges"][crossfit.name] = crossfit.fingerprints()
    run.save_manifest()
    task_report = task.evaluate(premises, replies, results, config.pairs_run, readouts, config.seed, rating=rating)
    for name in results:
        log.info("%s: %s", name, results[name])

    # 5. Write eval.json, every reply with its scores, the plots and the report; mark done. A CUDA graph
    #    that could not be captured fell back to eager decoding steps (slower, the same tokens): recorded.
    run.manifest["backends"]["decoder_fallbacks"] = list(fast.GRAPH_FAILURES)
    #    The verdict: a gain holds under held-out judges of two families and the fluency gate (common/verdict.py).
    for name, decided in (decide(results, judges, config, log_probs is not None) if judges else {}).items():
        results[name]["verdict"] = decided
    judge_info = {"judges": judges} if judges else {}
    write_json(run.dir / "eval.json", {**results, **task_report["baselines"], **judge_info})
    write_jsonl(run.dir / "replies.jsonl", [
        {"id": p["id"], "premise": task.display(p)[:2000], "reference": p["chosen"],
         **{name: {"reply": replies[name][i], **({"reward": rewards[name][i]} if rewards else {}),
                   **({"by_judge": {j: every_judge[j][name][i] for j in every_judge}} if every_judge else {}),
                   **task_report["per_reply"].get(name, [{}] * len(premises))[i],
                   **({"fluency_log_prob": _finite(log_probs[name][i])} if log_probs else {}),
                   **({"candidates": candidates[i], "candidate_scores": candidate_scores[i],
                       **({"candidate_log_probs": list(map(_finite, candidate_lps[i]))} if candidate_lps else {}),
                       **({"candidate_passed": passed[i]} if passed else {})}
                      if name == "best_of_n" and candidates else {})} for name in replies}}
        for i, p in enumerate(premises)])
    grpo = {name: read_json(path.parent / "metrics.json").get("per_step") for name, path in adapters.items()
            if read_json(path.parent / "manifest.json").get("stage") == "GRPO"}
    plots = {**plot_distributions(run.dir, replies, rewards, task.NOUNS["premises"]), **plot_watch(run.dir, grpo),
             **task_report["plots"](run.dir)}
    log_plots_to_wandb(plots)
    sections = task_report["sections"] + (judges_section(results, judges, family_lines(judges) +
                                                         gain_lines(results, judges))
                                          if config.judge_runs or crossfit else [])
    sections = eval_inputs.report_lines(run.manifest, task.NOUNS) + sections  # what was scored, when not the split
    sections = [part for line in eval_inputs.other_sft_lines(other_sft, config.sft_run) for part in ("", line)] + sections
    headline = verdict_lines(results, judges, {n: r["verdict"] for n, r in results.items() if "verdict" in r}) + \
        family_lines(judges) + (fluency_model_line(run.manifest.get("fluency", {}).get("fluency_family"),
                                                   model_family(config.model_name_or_path),
                                                   config.fluency_model_name_or_path)
                                if judges or log_probs else [])  # the report opens with it
    report = write_report(run.dir / "report.md", run.dir.name, results, premises, replies, rewards,
                          config.n_report_samples, plots, verdict, sections,
                          reading=f"the prompt cut to {config.max_prompt_tokens} tokens ({task.READING})" +
                          ("; the rating is also read on every window" if windows else ""),
                          decoding=describe_decoding(config, run.manifest), display=task.display, nouns=task.NOUNS,
                          headline=headline)
    run.finish({"verdict": headline, "models": results, **task_report["baselines"], **judge_info,
                "n_premises": len(premises), "report": str(report)})
    print(f"report: {report.resolve()}")


def _finite(value: float) -> float | None:
    """A reply too short to score has a nan log-probability: null in replies.jsonl, as JSON has no NaN."""
    return None if math.isnan(value) else value


def describe_decoding(config: EvalConfig, manifest: dict) -> str:
    """The decoding in words, for the report: this run's, or, with --replies_from, the source run's (its
    decoding fields are this config's; its best-of-n is the manifest's, copied from the source)."""
    parts = ["greedy" if config.temperature == 0 else f"sampled (temperature {config.temperature:g}, seed {config.seed})"]
    if config.repetition_penalty != 1:
        parts.append(f"repetition penalty {config.repetition_penalty:g}")
    if config.no_repeat_ngram_size:
        parts.append(f"no repeated {config.no_repeat_ngram_size}-gram")
    best = manifest.get("best_of_n")
    if best:
        parts.append(f"best_of_n: {best['n']} replies of {best['from']} sampled at temperature {best['temperature']:g}")
    said = ", ".join(parts)
    if config.replies_from:
        return f"read back from {Path(config.replies_from).name} (nothing generated here), written {said}"
    return said


def generation_speed(tokenizer, texts: list[str], seconds: float) -> dict:
    """Wall time of one model's generation and its new tokens a second (the replies re-tokenised)."""
    n = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    return {"seconds": round(seconds, 2), "new_tokens": n, "new_tokens_per_s": round(n / max(seconds, 1e-9), 1)}


def model_adapters(run) -> dict[str, Path]:
    """sft, then each policy under its stage's name (grpo, dpo, orpo; grpo_from_base for one that started on the
    base; a second of a kind gets a number)."""
    adapters = {}
    if run.config.sft_run:
        adapters["sft"] = Path(run.config.sft_run) / "adapter"
    for i, path in enumerate(run.config.policy_runs):
        recorded = run.inputs[f"policy_runs[{i}]"]
        name = recorded["stage"].lower() + ("_from_base" if recorded.get("started_from") == "base" else "")
        name = name if name not in adapters else f"{name}{i + 1}"
        adapters[name] = Path(path) / "adapter"
    return adapters


if __name__ == "__main__":
    cli(main, EvalConfig, __doc__)
