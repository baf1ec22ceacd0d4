"""Stage 02: supervised fine-tuning of the 4-bit base + rsLoRA on the winning replies (CMV) or the
structured reviews (review).

    python 02_train_sft.py --config configs/smol/02_train_sft.yaml --pairs_run runs/Nov30_Pairs_Run1
    python 02_train_sft.py --config configs/smol/review/02_train_sft.yaml --pairs_run runs/Dec01_Pairs_Run2
    python 02_train_sft.py --config configs/smol/02_train_sft.yaml --pairs_run runs/Nov30_Pairs_Run1 \
        --targets_from runs/Nov30_Eval_Run2 --sft_run runs/Nov30_SFT_Run1     # RAFT (common/raft.py)

Prompt/completion data: TRL masks the prompt, so the loss is on the reply only. Each example is cut
to fit `max_length` here rather than letting the trainer cut the reply off blindly: a CMV premise to
`max_prompt_tokens` and its reply at a sentence end; a paper, longer than the context, becomes one
example per window (`input_strategy: sliding_window`, `window_overlap`) each with the whole review,
or is cut to fit (`whole`, for a long-context base). Writes the adapter (adapter/) and metrics.json.
"""
from __future__ import annotations

import logging
from pathlib import Path

from datasets import Dataset
from transformers import set_seed
from trl import SFTConfig, SFTTrainer

from common import fast
from common.cli import cli
from common.config import SFTStageConfig
from common.data import train_and_dev
from common.model import CAUSAL_LM, fingerprint, load_model, load_tokenizer
from common.raft import best_of_n_targets, check_start
from common.runs import Run, settle
from common.tasks import get_task
from common.training import save_adapter, train, trainer_args

log = logging.getLogger("pipeline")


def sft_dataset(rows: list[dict], tokenizer, config: SFTStageConfig, task) -> Dataset:
    """Conversational prompt/completion examples that fit the token budget, as the task builds them
    (CMV: one per winner; review: one per window of the paper, each with the whole target)."""
    return Dataset.from_list([example for row in rows for example in task.sft_examples(row, tokenizer, config)])


def build_trainer(config: SFTStageConfig, run, model, tokenizer, train_rows, dev_rows) -> SFTTrainer:
    task = get_task(run.task)
    levers, run.manifest["memory_plan"] = fast.fit_memory(config, model)  # memory_levers fit: what this GPU needs
    settle(run, config, levers)  # on the config before the trainer is built, and in config.yaml: what ran
    args = trainer_args(SFTConfig, config, run, max_length=config.max_length,
                        completion_only_loss=True, per_device_eval_batch_size=config.per_device_train_batch_size)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer,
                         train_dataset=sft_dataset(train_rows, tokenizer, config, task),
                         eval_dataset=sft_dataset(dev_rows, tokenizer, config, task) if dev_rows else None)
    run.manifest["patches"] = fast.apply(trainer, config)
    run.manifest["backends"] = fast.backends(config, run.manifest["patches"])
    return trainer


def main(config: SFTStageConfig, overrides: dict) -> None:
    # 1. Seed and run directory; the pairs run must be finished. The manifest records which base
    #    this adapter belongs to (the base lock of every later stage).
    set_seed(config.seed)
    raft = {"targets_from": config.targets_from, "sft_run": config.sft_run}
    run = Run("SFT", config, overrides, inputs={"pairs_run": config.pairs_run, **{k: v for k, v in raft.items() if v}},
              base=fingerprint(config))
    run.start_tracking()

    # 2. Data: the winners of the train split (dev for a held-out loss).
    train_rows, dev_rows = train_and_dev(config.pairs_run, config.max_train_examples, config.max_eval_examples)
    if config.targets_from:  # RAFT: the best-of-n picks of an eval run of the train split instead (common/raft.py)
        train_rows, run.manifest["targets_from"] = best_of_n_targets(config.targets_from, train_rows,
                                                                      config.targets_without_greedy)
        if config.sft_run:  # from the adapter that sampled them
            check_start(run)
    log.info("SFT on %d train rows, dev loss on %d", len(train_rows), len(dev_rows))

    # 3. Model: 4-bit NF4 base + a fresh rank-64 rsLoRA adapter (RAFT with --sft_run: that run's, trained on).
    tokenizer = load_tokenizer(config)
    model = load_model(config, CAUSAL_LM, tokenizer=tokenizer,
                       adapter=Path(config.sft_run) / "adapter" if config.sft_run else None)
    run.manifest["started_from"] = "sft" if config.sft_run else "base"
    trainer = build_trainer(config, run, model, tokenizer, train_rows, dev_rows)

    # 4. Train (from the last checkpoint of this run if it was interrupted), evaluate, save.
    metrics = train(trainer, run)
    if dev_rows:
        metrics["dev"] = trainer.evaluate()
    save_adapter(model, tokenizer, run)
    metrics.update(n_train_examples=len(train_rows), n_dev_examples=len(dev_rows),
                   n_train_sequences=len(trainer.train_dataset))  # review: one per window of a paper
    run.finish(metrics)


if __name__ == "__main__":
    cli(main, SFTStageConfig, __doc__)
