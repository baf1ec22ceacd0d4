"""Stage 03: a reward model (4-bit base + rsLoRA + a one-number score head, or a fully fine-tuned
encoder classifier: `judge_backbone`) on winner vs loser, pairwise or pointwise (`judge_objective`).

    python 03_train_reward.py --config configs/smol/03_train_reward.yaml --pairs_run runs/Nov30_Pairs_Run1

pairwise: TRL's RewardTrainer (Bradley-Terry loss) on the pairs of `train_split`. pointwise: a
classifier on single replies, the winner labelled delta (1) and the loser no delta (0), binary
cross-entropy on the same one-number head (transformers' Trainer). Replies are cut to fit
`max_length` beforehand: RewardTrainer drops over-long pairs instead of cutting them, which would
undo the length balancing of stage 01 (what it drops anyway is counted). Writes the adapter with
its score head (adapter/), train_posts.json (the posts trained on: 05 refuses a judge that would
score one of them), <audit_split>_scores.jsonl, and metrics.json with the `audit_split` (default dev)
`accuracy`, `mean_margin`, `length_only_accuracy` and `score_length_spearman`, and judge_audit.json
(common/audit.py): the judge's accuracy next to a length-only and a bag-of-words baseline trained on
the same pairs, its score-length correlation, shortcut probes and a verdict. `train_split: dev` (or
test) makes a held-out judge for 05's --judge_runs (docs/results.md). When the pairs run was split by
period (stage 01's `split_by: period`), the audit names test the later period and dev in-period, with
both baselines on each. `cross_fit_folds: k` with `cross_fit_fold: j` trains on all but fold j of
train_split's posts (folds by a hash of the post id) and audits fold j too (`test_fold<j>`): the k
runs are 05's --crossfit_judge_runs; `train_also` adds more splits' pairs. `early_stopping_patience` judges the audit split after every epoch and keeps
the epoch of lowest loss there. `--corruptions` adds (real reply over its corruption) pairs and
`--hard_negatives` an Eval run's replies as losers to the real winners of their posts; the audit's
`corruption` key says how often the judge prefers real replies to corruptions (docs/results.md).
`topic_gate` subtracts a penalty for a reply with little in common with its post (topic_gate.json).
`judge_backbone: features` fits a logistic regression on Tan et al.'s features instead
(feature_judge.json, no neural model); `ensemble` combines the judge runs of `ensemble_of`
(ensemble.json); both are judged and audited as the others. The manifest's `base` is the
pipeline's base (model_name_or_path, what stages 04/05 lock on) and its `judge` the judge's own backbone.
"""
from __future__ import annotations

import logging
from pathlib import Path

from transformers import EarlyStoppingCallback, Trainer, TrainingArguments, set_seed
from trl import RewardConfig, RewardTrainer

from common import fast
from common.audit import write_judge_audit
from common.cli import cli
from common.config import RewardStageConfig, load_run_config
from common.corruptions import corruption_pairs
from common.data import DataError, cross_fit, load_split, write_jsonl
from common.ensemble import EnsembleScorer, check_members
from common.feature_judge import FeatureScorer
from common.hard_negatives import hard_negative_pairs, parse
from common.judges import write_train_posts
from common.metrics import preference_metrics, wins
from common.model import fingerprint
from common.rewards import (
    PadRight,
    RewardScorer,
    judge_fingerprint,
    pointwise_dataset,
    pointwise_loss,
    preference_dataset,
    set_up_like_reward_trainer,
)
from common.runs import Run, RunError, settle
from common.tasks import get_task
from common.topic_gate import TopicGated
from common.training import save_adapter, train, trainer_args

log = logging.getLogger("pipeline")


def build_trainer(config: RewardStageConfig, run, scorer, train_rows: list[dict], dev_rows: list[dict]):
    """Pairwise: TRL's RewardTrainer on (winner, loser); pointwise: the Trainer with BCE on single replies.
    With early stopping the audit split's loss is measured after every epoch and the best epoch's weights
    are kept. Returns the trainer and how many pairs RewardTrainer dropped for their length."""
    model, tokenizer = scorer.model, scorer.tokenizer
    stopping = dict(eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", greater_is_better=False) if config.early_stopping_patience else {}
    if stopping and not dev_rows:
        raise RunError(f"early_stopping_patience: no {config.audit_split} pairs to stop on")
    callbacks = [EarlyStoppingCallback(config.early_stopping_patience)] if stopping else None
    levers, run.manifest["memory_plan"] = fast.fit_memory(config, model)  # memory_levers fit: what this GPU needs
    settle(run, config, levers)  # on the config before the trainer is built, and in config.yaml: what ran
    if config.judge_objective == "pairwise":
        train_set = preference_dataset(train_rows, scorer)
        trainer = RewardTrainer(model=model, args=trainer_args(RewardConfig, config, run, max_length=config.max_length,
                                                               **stopping),
                                processing_class=tokenizer, train_dataset=train_set, callbacks=callbacks,
                                eval_dataset=preference_dataset(dev_rows, scorer) if stopping else None)
    else:  # the scorer already cut every reply to max_length: nothing is dropped
        train_set = pointwise_dataset(train_rows, scorer)
        set_up_like_reward_trainer(model, config.gradient_checkpointing)
        trainer = Trainer(model=model, args=trainer_args(TrainingArguments, config, run, **stopping),
                          train_dataset=train_set, eval_dataset=pointwise_dataset(dev_rows, scorer) if stopping else None,
                          processing_class=tokenizer, data_collator=PadRight(tokenizer.pad_token_id),
                          compute_loss_func=pointwise_loss, callbacks=callbacks)
    run.manifest["patches"] = fast.apply(trainer, config)
    run.manifest["backends"] = fast.backends(config, run.manifest["patches"], judge_scoring=scorer.scoring)
    return trainer, len(train_set) - len(trainer.train_dataset)


def train_model_judge(config: RewardStageConfig, run, train_rows: list[dict], hard_rows: list[dict],
                      hard_counts: dict, dev_rows: list[dict]):
    """Steps 3-4 of a model judge; returns its scorer, the run's metrics so far, the pairs dropped for their
    length and the corruption pairs' counts."""
    # 3. Model: a sequence classifier with num_labels=1 (4-bit + LoRA, the head trained with it; or
    #    an encoder, fully fine-tuned), wrapped in the scorer that encodes its inputs. Pairwise: TRL's
    #    RewardTrainer on (winner, loser); pointwise: the Trainer with BCE on single replies.
    #    --corruptions: each kind's (real reply over its corruption) pairs, made of what the judge reads of
    #    each reply (common/corruptions.py).
    scorer = RewardScorer.load(config, batch_size=config.per_device_train_batch_size, packed=config.fast_paths)
    model, tokenizer = scorer.model, scorer.tokenizer
    bad_rows, bad_counts = corruption_pairs(train_rows, config.corruptions, config.seed, config.corruption_share,
                                            scorer.visible_reply) if config.corruptions else ([], {})
    log.info("plus %d corruption pairs %s and %d hard-negative pairs %s", len(bad_rows),
             bad_counts.get("corruption_pairs", {}), len(hard_rows), hard_counts)
    trainer, n_dropped = build_trainer(config, run, scorer, train_rows + hard_rows + bad_rows, dev_rows)
    if n_dropped:
        log.warning("RewardTrainer dropped %d pairs longer than max_length=%d", n_dropped, config.max_length)

    # 4. Train (resuming this run's last checkpoint if any), save adapter + head.
    metrics = train(trainer, run)
    if config.early_stopping_patience:  # the weights now are the best epoch's (load_best_model_at_end)
        metrics["early_stopping"] = {"best_step": trainer.state.best_global_step,
                                     f"best_{config.audit_split}_loss": trainer.state.best_metric,
                                     "epochs_trained": trainer.state.epoch}
    save_adapter(model, tokenizer, run)
    return scorer, metrics, n_dropped, bad_counts


def main(config: RewardStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory; the pairs run must be finished; the base lock.
    set_seed(config.seed)
    members = check_members(config) if config.judge_backbone == "ensemble" else []  # an ensemble's judge runs
    hard = {f"hard_negatives[{i}]": parse(spec, [])[0] for i, spec in enumerate(config.hard_negatives)}
    run = Run("Reward", config, overrides, inputs={"pairs_run": config.pairs_run, **hard},
              base=fingerprint(config))  # the pipeline's base, which 04 and 05 compare
    own_judge = getattr(get_task(run.task), "train_judge", None)  # the task decides what its judge learns
    if not get_task(run.task).PAIRWISE and not own_judge:
        raise RunError(f"{config.pairs_run} is a {run.task} pairs run: a judge trains on winner-vs-loser pairs, "
                       f"which this task does not have")
    run.manifest["judge"] = judge_fingerprint(config)  # the judge's own backbone (RewardScorer.from_run)
    run.save_manifest()
    run.start_tracking()
    if own_judge:  # review: a rating model, a paper -> its mean reviewer rating (common/rating_model.py)
        run.finish(own_judge(config, run))
        return

    # 2. Data: winner-vs-loser pairs of the split the judge trains on, and of train_also's (their posts
    #    recorded for 05's overlap check); the held-out audit split for the judge's report. Cross-fitting
    #    leaves one fold of train_split's posts out, judged by the audit as <train_split>_fold<k>.
    #    --hard_negatives: a policy's replies (an Eval run's) lose to the real winners of their posts, which
    #    must be posts the judge trains on (common/hard_negatives.py).
    train_rows, left_out = training_pairs(config)
    dev_rows = load_split(config.pairs_run, config.audit_split)[: config.max_eval_examples]
    hard_rows, hard_counts = hard_negative_pairs(
        config.hard_negatives, config.hard_negative_models, config.pairs_run, [config.train_split, *config.train_also],
        {r["group_id"] for rows in left_out.values() for r in rows}, get_task(run.task).display) \
        if config.hard_negatives else ([], {})
    if hard_counts:
        run.manifest["hard_negatives"] = hard_counts  # pairs per RUN:MODEL; each run's digest is under `inputs`
        run.save_manifest()
    write_train_posts(run.dir, config.train_split, train_rows + hard_rows, train_also=config.train_also,
                      cross_fit={"folds": config.cross_fit_folds, "fold": config.cross_fit_fold} if left_out else None)
    log.info("%s judge on %d %s pairs, judged on %d %s pairs", config.judge_objective, len(train_rows),
             config.train_split, len(dev_rows), config.audit_split)

    # 3'. No neural model: the feature judge is a logistic regression fitted here (feature_judge.json, on the
    #     hard-negative and corruption pairs too); an ensemble loads its judge runs and measures each one's scale
    #     on the train replies (ensemble.json, train_posts.json: its members' posts). Both are audited below.
    if config.judge_backbone in ("features", "ensemble"):
        (scorer, bad_counts), metrics, n_dropped = fit_without_training(config, run, train_rows, hard_rows, members), {}, 0
    else:  # 3-4. A model judge, trained (train_model_judge)
        scorer, metrics, n_dropped, bad_counts = train_model_judge(config, run, train_rows, hard_rows, hard_counts, dev_rows)

    scorer = with_topic_gate(config, run, scorer, train_rows, metrics)  # 4'. topic_gate > 0: gated (topic_gate.json)

    # 5. Judge the audit split with the same scorer that stages 04 and 05 use.
    prompts = [r["prompt"] for r in dev_rows]
    chosen = scorer.score(prompts, [r["chosen"] for r in dev_rows])
    rejected = scorer.score(prompts, [r["rejected"] for r in dev_rows])
    scores = [{"id": r["id"], "chosen_score": c, "rejected_score": j} for r, c, j in zip(dev_rows, chosen, rejected)]
    if isinstance(scorer, TopicGated):  # and the same judge's own scores: what the gate alone changed
        ungated_accuracy = add_ungated_scores(scorer, prompts, dev_rows, scores)
        metrics["topic_gate"]["accuracy_without_gate"] = ungated_accuracy
    write_jsonl(run.dir / f"{config.audit_split}_scores.jsonl", scores)
    dev = preference_metrics(dev_rows, chosen, rejected)
    log.info("%s: %s", config.audit_split, dev)
    metrics.update(dev, metrics_split=config.audit_split, judge_objective=config.judge_objective,
                   train_split=config.train_split, train_also=config.train_also, n_train_pairs=len(train_rows),
                   n_train_pairs_dropped_too_long=n_dropped, **bad_counts, hard_negative_pairs=hard_counts)

    # 6. The audit (judge_audit.json): baselines, length correlation, shortcut probes, gibberish, verdict.
    #    A pairs run split by period holds the source's later posts in test: the audit names it.
    #    Every held-out split is judged, a left-out fold too; a split the judge trained on is no audit, and a
    #    pairs run written before dev_later existed has no such file.
    extra = {s: load_split(config.pairs_run, s)[: config.max_eval_examples]
             for s in config.audit_extra_splits if s not in (config.audit_split, config.train_split, *config.train_also)
             and (Path(config.pairs_run) / f"{s}.jsonl").is_file()}
    extra.update(left_out)
    split_by = load_run_config(config.pairs_run).split_by
    periods = {s: "period" if s.split("_fold")[0] in ("test", "dev_later") else "in-period"
               for s in [config.audit_split, *extra]} \
        if split_by == "period" else {}
    metrics["split_by"] = split_by
    metrics["judge_audit"] = write_judge_audit(run.dir, scorer, train_rows, dev_rows, chosen, rejected, extra,
                                               config.seed, split=config.audit_split, periods=periods,
                                               probes=get_task(run.task).PROBES,
                                               corruption_splits=gibberish_splits(config, extra, dev_rows))
    run.finish(metrics)


def fit_without_training(config: RewardStageConfig, run, train_rows: list[dict], hard_rows: list[dict],
                         members: list[dict]):
    """The feature judge fitted on the train pairs, the hard-negative ones and the train pairs' corruptions, or
    the ensemble of judge runs (`members`) built; saved in the run. Returns it and the corruption pairs' counts."""
    if config.judge_backbone == "features":
        bad_rows, bad_counts = corruption_pairs(train_rows, config.corruptions, config.seed, config.corruption_share) \
            if config.corruptions else ([], {})
        scorer = FeatureScorer.fit(train_rows + hard_rows + bad_rows)
        scorer.name = run.dir.name
        scorer.save(run.dir)
        return scorer, bad_counts
    return EnsembleScorer.build(config, run.dir, members, train_rows, batch_size=config.per_device_train_batch_size,
                                packed=config.fast_paths), {}


def with_topic_gate(config: RewardStageConfig, run, scorer, train_rows: list[dict], metrics: dict):
    """With topic_gate > 0, the judge minus a penalty for a reply with less in common with its post than all but
    topic_gate_quantile of the train pairs' real replies (common/topic_gate.py), saved in the run and described
    in `metrics`; else the judge itself."""
    if not config.topic_gate:
        return scorer
    gated = TopicGated.fit(scorer, train_rows, config.topic_gate, config.topic_gate_quantile, config.topic_gate_encoder)
    gated.save(run.dir)
    metrics["topic_gate"] = {k: v for k, v in gated.fitted.items() if k not in ("topic_gate", "topic_gate_quantile")}
    log.info("topic gate: %s", metrics["topic_gate"])
    return gated


def add_ungated_scores(gated: TopicGated, prompts: list, rows: list[dict], scores: list[dict]) -> float:
    """Each audit pair's scores without the gate (`chosen_ungated`, `rejected_ungated`: the gated score plus its
    penalty), so that the gate's cost is read on the same trained judge, free of a second training's noise;
    returns that judge's accuracy without the gate."""
    for side in ("chosen", "rejected"):
        penalty = gated.penalty(prompts, [r[side] for r in rows])
        for row, p in zip(scores, penalty):
            row[f"{side}_ungated"] = row[f"{side}_score"] + float(p)
    return float(wins([s["chosen_ungated"] for s in scores], [s["rejected_ungated"] for s in scores]).mean())


def gibberish_splits(config: RewardStageConfig, extra: dict[str, list[dict]], dev_rows: list[dict]) -> dict:
    """The gibberish audit's pairs: real replies against their corruptions on dev_later and test, those the judge
    did not train on (else the audit split)."""
    trained = (config.train_split, *config.train_also)
    splits = {s: extra.get(s) or load_split(config.pairs_run, s)[: config.max_eval_examples]
              for s in ("dev_later", "test") if s not in trained and (Path(config.pairs_run) / f"{s}.jsonl").is_file()}
    return {s: rows for s, rows in splits.items() if rows} or {config.audit_split: dev_rows}


def training_pairs(config: RewardStageConfig) -> tuple[list[dict], dict[str, list[dict]]]:
    """The pairs the judge trains on: train_split's (cross-fitting: but those of the left-out fold's
    posts), then train_also's, cut to max_train_examples (never none); and the left-out fold's pairs
    under their audit name ({"test_fold1": [...]}; {} without cross-fitting)."""
    rows, left_out = load_split(config.pairs_run, config.train_split), {}
    if config.cross_fit_folds:
        rows, out = cross_fit(rows, config.cross_fit_folds, config.cross_fit_fold)
        left_out[f"{config.train_split}_fold{config.cross_fit_fold}"] = out[: config.max_eval_examples]
    for split in config.train_also:
        rows = rows + load_split(config.pairs_run, split)
    rows = rows[: config.max_train_examples]
    if not rows:
        raise DataError(f"{config.pairs_run}: no {'+'.join([config.train_split, *config.train_also])} pairs to "
                        f"train on" + (f" outside fold {config.cross_fit_fold}" if left_out else ""))
    return rows, left_out


if __name__ == "__main__":
    cli(main, RewardStageConfig, __doc__)
