"""What the three training stages share: TRL arguments from our config, resuming, saving."""
from __future__ import annotations

import logging
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

from common.config import TrainArgs
from common.model import precision_flags

log = logging.getLogger("pipeline")


def trainer_args(cls, config: TrainArgs, run, **extra):
    """A TRL config (SFTConfig, RewardConfig, GRPOConfig) for this run: checkpoints inside the run
    directory, our optimisation fields, bf16 only on GPUs, W&B only when asked for."""
    return cls(
        output_dir=str(run.dir / "checkpoints"),
        run_name=run.dir.name,
        seed=config.seed,
        learning_rate=config.learning_rate,
        num_train_epochs=config.num_train_epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.per_device_train_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        warmup_steps=config.warmup_ratio,  # a float below 1 is a share of the steps
        lr_scheduler_type=config.lr_scheduler_type,
        weight_decay=config.weight_decay,
        activation_checkpointing=config.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=config.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=2,
        report_to=["wandb"] if config.report_to == "wandb" else "none",
        disable_tqdm=True,
        **precision_flags(),
        **extra,
    )


def train(trainer, run) -> dict:
    """Train, continuing from the run's own last checkpoint when there is one (a resumed or
    requeued run), and return the trainer's final numbers plus its per-step log."""
    checkpoint = get_last_checkpoint(str(run.dir / "checkpoints")) if (run.dir / "checkpoints").is_dir() else None
    if checkpoint:
        log.info("resuming from %s", checkpoint)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    return {"train": dict(result.metrics), "global_step": trainer.state.global_step,
            "resumed_from": checkpoint, "log_history": trainer.state.log_history}


def save_adapter(model, tokenizer, run) -> Path:
    out = run.dir / "adapter"
    model.save_pretrained(out)  # safetensors; for the reward model it holds the score head too
    tokenizer.save_pretrained(out)
    return out
