"""What the three training stages share: TRL arguments from our config, resuming, saving."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from common.config import TrainArgs
from common.model import precision_flags
from common.runs import RunError, is_main_process

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


class MemoryPerStep(TrainerCallback):
    """On a GPU, each optimiser step's own peak of allocated memory, what is still allocated at its end and what
    the allocator holds (GiB). In a run whose memory is flat the peaks follow the size of each step's batches
    and the memory allocated at a step's end does not grow; a leak shows as a step-end allocation that climbs.
    In metrics.json as `gpu_memory_per_step` (and `gpu_peak_gib`, the run's peak), in the log every
    `logging_steps`. The peak counter is reset at each step's start; `peak_gib` keeps the most of what came
    before the first step and of every step."""

    def __init__(self):
        self.steps, self.peak_gib = [], 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            self.peak_gib = max(self.peak_gib, torch.cuda.max_memory_allocated() / 2 ** 30)
            torch.cuda.reset_peak_memory_stats()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            gib = 2 ** 30
            peak = torch.cuda.max_memory_allocated() / gib
            self.peak_gib = max(self.peak_gib, peak)
            self.steps.append({"step": state.global_step, "peak_gib": round(peak, 3),
                               "allocated_gib": round(torch.cuda.memory_allocated() / gib, 3),
                               "reserved_gib": round(torch.cuda.memory_reserved() / gib, 3)})
            if args.logging_steps and state.global_step % args.logging_steps == 0:
                log.info("step %d: GPU memory peak %.2f GiB, allocated at its end %.2f GiB, reserved %.2f GiB",
                         state.global_step, peak, self.steps[-1]["allocated_gib"], self.steps[-1]["reserved_gib"])


def trainer_args(cls, config: TrainArgs, run, **extra):
    """A TRL config (SFTConfig, RewardConfig, GRPOConfig) for this run: checkpoints inside the run
    directory, our optimisation fields, bf16 only on GPUs, W&B only when asked for. `extra` adds or
    replaces arguments (early stopping evaluates and saves every epoch instead of every save_steps)."""
    args = dict(
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
        **_checkpointing(cls, config),
        # Real replies vary in length: batches of similar length carry little padding (bench/RESULTS.md).
        train_sampling_strategy="group_by_length" if config.group_by_length else "random",
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
        **_padding(cls, config),
    )
    return cls(**{**args, **extra})


def _padding(cls, config: TrainArgs) -> dict:
    """TRL's collators pad to a multiple of pad_to_multiple_of (every TRL config has the field)."""
    has = "pad_to_multiple_of" in {f.name for f in dataclasses.fields(cls)}
    return {"pad_to_multiple_of": config.pad_to_multiple_of} if has and config.pad_to_multiple_of else {}


def _checkpointing(cls, config: TrainArgs) -> dict:
    """Activation checkpointing under the name this transformers has (5.24: activation_*, 5.17: gradient_*).
    With offload_activations the reentrant variant is needed: it saves each layer's input through
    autograd's saved-tensor hooks, which `offload_saved_activations` moves to CPU memory (the
    non-reentrant variant keeps it on the GPU)."""
    prefix = "activation" if "activation_checkpointing" in {f.name for f in dataclasses.fields(cls)} else "gradient"
    return {f"{prefix}_checkpointing": config.gradient_checkpointing,
            f"{prefix}_checkpointing_kwargs": {"use_reentrant": bool(config.offload_activations)}}


def last_checkpoint(folder: Path) -> str | None:
    """The newest complete checkpoint to resume from. The Trainer writes trainer_state.json last: a job
    killed while saving leaves a checkpoint without it, or with it cut short, and resuming from that would
    fail or count steps from 0 again; the previous complete checkpoint is used instead. A checkpoint of
    the last step (a run killed while saving its adapter or evaluating) is passed over too: resumed there,
    the Trainer trains one step past max_steps (it checks the step count only after a step), whereas from
    the checkpoint before it trains the same last steps as the uninterrupted run."""
    steps = {int(p.name.split("-")[1]): p for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()}
    for step in sorted(steps, reverse=True):
        try:
            state = json.loads((steps[step] / "trainer_state.json").read_text())
        except (OSError, ValueError):
            log.warning("ignoring the incomplete checkpoint %s (trainer_state.json missing or cut short)", steps[step])
            continue
        if 0 < state.get("max_steps", 0) <= state.get("global_step", 0):
            log.info("%s is the run's last step: the run continues from the checkpoint before it", steps[step])
            continue
        return str(steps[step])
    return None


def train(trainer, run) -> dict:
    """Train, continuing from the run's own last checkpoint when there is one (a resumed or
    requeued run), and return the numbers of the whole run (every segment of it) plus its per-step log."""
    checkpoint = last_checkpoint(run.dir / "checkpoints")
    if checkpoint:
        log.info("resuming from %s", checkpoint)
    stopper, memory = StopOnRequest(), MemoryPerStep()
    trainer.add_callback(stopper)
    trainer.add_callback(memory)
    previous = {sig: signal.signal(sig, stopper.request) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    started = time.time()
    try:
        result = trainer.train(resume_from_checkpoint=checkpoint)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as err:
        # a file cut short is torch's RuntimeError of its zip reader; any other RuntimeError is not ours
        if checkpoint is None or (isinstance(err, RuntimeError) and "PytorchStreamReader" not in str(err)):
            raise
        # torch.load refuses a file that is not plain tensors (weights_only): a damaged or tampered checkpoint
        raise RunError(f"checkpoint {checkpoint} is damaged: a file of it cannot be loaded ("
                       f"{(str(err).splitlines() or [type(err).__name__])[0][:120]}); delete that checkpoint folder "
                       f"to continue from the one before it, or start a new run") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # Each segment (first start, every resume) is recorded, so the run's runtime is the sum.
        # patches and backends are this segment's: a resumed segment may run on other hardware or code
        run.manifest.setdefault("segments", []).append(
            {"from_step": _step_of(checkpoint), "to_step": trainer.state.global_step,
             "runtime_s": round(time.time() - started, 2), "patches": run.manifest.get("patches"),
             "backends": run.manifest.get("backends")})
        run.save_manifest()
    if stopper.stopped_at is not None:
        log.warning("stopped on request at step %d of %d with a checkpoint in %s; the run is not DONE: "
                    "continue it with --resume %s", stopper.stopped_at, trainer.state.max_steps,
                    run.dir / "checkpoints", run.dir)
        raise Interrupted(STOP_EXIT_CODE)
    # Accelerate wraps the model's forward in the run's autocast (bf16 on a GPU) for good: what a stage does with
    # the model after training (the judge's audit, the rating model's dev ratings) must run as stage 05 runs it.
    trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    # For the same reason fp32 matmuls go back to full precision: the trainer's arguments turned TF32 on for the
    # whole process (precision_flags), and stage 05's process never does.
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    history = trainer.state.log_history  # restored from the checkpoint: it covers the earlier segments
    metrics = {"train": {**dict(result.metrics), **whole_run_metrics(history, run.manifest["segments"])},
               "global_step": trainer.state.global_step, "resumed_from": checkpoint, "log_history": history,
               "gpu_memory_per_step": memory.steps, "gpu_peak_gib": round(memory.peak_gib, 3) if memory.steps else None}
    # A run whose weights are NaN or inf would finish DONE and be used by later stages as a model.
    if not all(torch.isfinite(p).all() for p in trainer.model.parameters() if p.requires_grad):
        run.fail(metrics, f"training diverged: the trained weights hold NaN or inf after step "
                          f"{trainer.state.global_step}; the run is not usable (lower learning_rate)")
    return metrics


def whole_run_metrics(log_history: list[dict], segments: list[dict]) -> dict:
    """train_loss and runtime over every segment of a run. The Trainer's own cover only the last
    segment after a resume; the logged losses cover them all (each the mean over its logging window)."""
    loss, previous, steps = 0.0, 0, 0
    for entry in log_history:
        if "loss" in entry and "step" in entry:
            width = max(entry["step"] - previous, 1)
            loss, steps, previous = loss + entry["loss"] * width, steps + width, entry["step"]
    return {"train_loss": loss / steps if steps else None,
            "train_runtime": round(sum(s["runtime_s"] for s in segments), 2), "n_segments": len(segments)}


def _step_of(checkpoint: str | None) -> int:
    return int(Path(checkpoint).name.split("-")[1]) if checkpoint else 0


def save_adapter(model, tokenizer, run) -> Path:
    out = run.dir / "adapter"
    if not is_main_process():  # one writer when every process of a launch gets here
        return out
    model.save_pretrained(out)  # safetensors; for the reward model it holds the score head too
    tokenizer.save_pretrained(out)
    return out
