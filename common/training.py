"""What the three training stages share: TRL arguments from our config, resuming, saving."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from common.config import TrainArgs
from common.model import precision_flags

log = logging.getLogger("pipeline")

# A stage that checkpointed and stopped on request exits with this (EX_TEMPFAIL, "try again later"):
# its run is unfinished (no DONE) and `--resume RUN_DIR`, or the requeued Slurm job, continues it.
STOP_EXIT_CODE = 75
# The Slurm wrapper creates this file on its USR1: under `accelerate launch`, and across nodes, it
# cannot signal the training processes itself (and USR1 would kill the launcher).
STOP_FILE_ENV = "PIPELINE_STOP_FILE"


class Interrupted(SystemExit):
    """Training saved a checkpoint and stopped on request. A SystemExit, so it passes the stage's
    code and its run.finish() (no DONE is written) and the process exits with STOP_EXIT_CODE."""


class StopOnRequest(TrainerCallback):
    """Checkpoint and stop at the next optimiser step when asked: SIGUSR1 or SIGTERM to this process
    (a manual stop; Slurm preemption TERMs every process of the job), or the stop file."""

    def __init__(self):
        self.requested = False
        self.stopped_at = None  # the global step it stopped at, if it did

    def request(self, signum, frame):  # a signal handler only sets a flag; the step end acts on it
        self.requested = True

    def on_step_end(self, args, state, control, **kwargs):
        stop_file = os.environ.get(STOP_FILE_ENV)
        stop = self.requested or bool(stop_file and os.path.exists(stop_file))
        if dist.is_available() and dist.is_initialized():  # all ranks must stop at the same step
            flag = torch.tensor([int(stop)], device=args.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop and state.global_step < state.max_steps:  # at the last step it ends (and saves) anyway
            control.should_save = control.should_training_stop = True
            self.stopped_at = state.global_step
        return control


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
        # DDP: every LoRA weight gets a gradient, and the unused-parameter search (the default for
        # a PeftModel) costs time and breaks with activation checkpointing. No effect in one process.
        ddp_find_unused_parameters=False,
        report_to=["wandb"] if config.report_to == "wandb" else "none",
        disable_tqdm=True,
        **precision_flags(),
        **extra,
    )


def last_checkpoint(folder: Path) -> str | None:
    """The newest complete checkpoint. The Trainer writes trainer_state.json last: a job killed while
    saving leaves a checkpoint without it, and resuming from that would count steps from 0 again."""
    steps = {int(p.name.split("-")[1]): p for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()}
    complete = [step for step, p in steps.items() if (p / "trainer_state.json").is_file()]
    for step in sorted(set(steps) - set(complete)):
        log.warning("ignoring the incomplete checkpoint %s (no trainer_state.json)", steps[step])
    return str(steps[max(complete)]) if complete else None


def train(trainer, run) -> dict:
    """Train, continuing from the run's own last checkpoint when there is one (a resumed or
    requeued run), and return the trainer's final numbers plus its per-step log."""
    checkpoint = last_checkpoint(run.dir / "checkpoints")
    if checkpoint:
        log.info("resuming from %s", checkpoint)
    stopper = StopOnRequest()
    trainer.add_callback(stopper)
    previous = {sig: signal.signal(sig, stopper.request) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopper.stopped_at is not None:
        log.warning("stopped on request at step %d of %d with a checkpoint in %s; the run is not DONE: "
                    "continue it with --resume %s", stopper.stopped_at, trainer.state.max_steps,
                    run.dir / "checkpoints", run.dir)
        raise Interrupted(STOP_EXIT_CODE)
    return {"train": dict(result.metrics), "global_step": trainer.state.global_step,
            "resumed_from": checkpoint, "log_history": trainer.state.log_history}


def save_adapter(model, tokenizer, run) -> Path:
    out = run.dir / "adapter"
    if int(os.environ.get("RANK", "0")) != 0:  # one writer when every process of a launch gets here
        return out
    model.save_pretrained(out)  # safetensors; for the reward model it holds the score head too
    tokenizer.save_pretrained(out)
    return out
