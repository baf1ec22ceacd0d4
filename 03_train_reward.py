"""Stage 03: a reward model (4-bit base + rsLoRA + a one-number score head) on winner vs loser.

    python 03_train_reward.py --config configs/smol/03_train_reward.yaml --pairs_run runs/Nov30_Pairs_Run1

TRL's RewardTrainer (Bradley-Terry loss) on the train split's pairs. Both replies are cut to fit
`max_length` beforehand: the trainer drops over-long pairs instead of cutting them, which would
undo the length balancing of stage 01 (what it drops anyway is counted). Writes the adapter with
its score head (adapter/), dev_scores.jsonl, and metrics.json with the dev `accuracy`,
`mean_margin`, `length_only_accuracy` and `score_length_spearman`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from datasets import Dataset
from transformers import set_seed
from trl import RewardConfig, RewardTrainer

from common.config import ModelArgs, RunArgs, TrainArgs
from common.data import fit_prompt, fit_reply, load_split, write_jsonl
from common.metrics import preference_metrics
from common.model import SEQ_CLS, fingerprint, load_model, load_tokenizer
from common.rewards import RewardScorer
from common.runs import Run, cli
from common.training import save_adapter, train, trainer_args

log = logging.getLogger("pipeline")


@dataclass
class RewardStageConfig(RunArgs, ModelArgs, TrainArgs):
    pairs_run: str | None = None
    max_prompt_tokens: int = 512
    max_length: int = 768
    max_eval_examples: int | None = None


def preference_dataset(rows: list[dict], tokenizer, config: RewardStageConfig) -> Dataset:
    examples = []
    for row in rows:
        prompt = fit_prompt(tokenizer, row["prompt"], config.max_prompt_tokens)
        examples.append({"prompt": prompt,
                         "chosen": [{"role": "assistant", "content": fit_reply(tokenizer, prompt, row["chosen"], config.max_length)}],
                         "rejected": [{"role": "assistant", "content": fit_reply(tokenizer, prompt, row["rejected"], config.max_length)}]})
    return Dataset.from_list(examples)


def main(config: RewardStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory; the pairs run must be finished; the base lock.
    set_seed(config.seed)
    run = Run("Reward", config, overrides, inputs={"pairs_run": config.pairs_run})
    run.lock_base(fingerprint(config))
    run.start_tracking()

    # 2. Data: winner-vs-loser pairs of the train split; dev for the judge's report.
    train_rows = load_split(config.pairs_run, "train")[: config.max_train_examples]
    dev_rows = load_split(config.pairs_run, "dev")[: config.max_eval_examples]
    log.info("reward model on %d pairs, judged on %d dev pairs", len(train_rows), len(dev_rows))

    # 3. Model: 4-bit sequence classifier with num_labels=1; the score head trains with the LoRA.
    tokenizer = load_tokenizer(config)
    model = load_model(config, SEQ_CLS, tokenizer=tokenizer)
    args = trainer_args(RewardConfig, config, run, max_length=config.max_length)
    train_set = preference_dataset(train_rows, tokenizer, config)
    trainer = RewardTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=train_set)
    n_dropped = len(train_set) - len(trainer.train_dataset)
    if n_dropped:
        log.warning("RewardTrainer dropped %d pairs longer than max_length=%d", n_dropped, config.max_length)

    # 4. Train (resuming this run's last checkpoint if any), save adapter + head.
    metrics = train(trainer, run)
    save_adapter(model, tokenizer, run)

    # 5. Judge the dev split with the same scorer that stages 04 and 05 use.
    scorer = RewardScorer(model, tokenizer, config.max_prompt_tokens, config.max_length,
                          config.per_device_train_batch_size)
    prompts = [r["prompt"] for r in dev_rows]
    chosen = scorer.score(prompts, [r["chosen"] for r in dev_rows])
    rejected = scorer.score(prompts, [r["rejected"] for r in dev_rows])
    write_jsonl(run.dir / "dev_scores.jsonl", [{"id": r["id"], "chosen_score": c, "rejected_score": j}
                                               for r, c, j in zip(dev_rows, chosen, rejected)])
    dev = preference_metrics(dev_rows, chosen, rejected)
    log.info("dev: %s", dev)
    metrics.update(dev, dev=dev, n_train_pairs=len(train_rows), n_train_pairs_dropped_too_long=n_dropped)
    run.finish(metrics)


if __name__ == "__main__":
    cli(main, RewardStageConfig)
