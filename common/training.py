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
    args = cls(
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
        **extra,
    )
    args.offload_activations = config.offload_activations  # read by train()
    args.liger_kernel = config.liger_kernel  # read by train(); not TrainingArguments' use_liger_kernel (below)
    args.mlp_chunk_tokens = config.mlp_chunk_tokens
    return args


def _checkpointing(cls, config: TrainArgs) -> dict:
    """Activation checkpointing under the name this transformers has (5.24: activation_*, 5.17: gradient_*).
    With offload_activations the reentrant variant is needed: it saves each layer's input through
    autograd's saved-tensor hooks, which save_on_cpu moves to CPU memory (the non-reentrant variant
    keeps it on the GPU)."""
    import dataclasses
    prefix = "activation" if "activation_checkpointing" in {f.name for f in dataclasses.fields(cls)} else "gradient"
    return {f"{prefix}_checkpointing": config.gradient_checkpointing,
            f"{prefix}_checkpointing_kwargs": {"use_reentrant": bool(config.offload_activations)}}


def _add_length_column(trainer) -> None:
    """group_by_length: the sampler reads lengths from `input_ids` (SFT); a preference dataset
    (chosen_ids, rejected_ids) gets a `length` column, the longer reply of each pair (the collator pads
    both to it), kept through the trainer's column filter."""
    data, name = trainer.train_dataset, trainer.args.length_column_name
    if getattr(trainer.args, "train_sampling_strategy", None) != "group_by_length" or data is None \
            or not hasattr(data, "column_names") or "input_ids" in data.column_names or name in data.column_names:
        return
    id_columns = [c for c in data.column_names if c.endswith("_ids")]
    if not id_columns:
        return
    trainer.train_dataset = data.map(lambda row: {name: max(len(row[c]) for c in id_columns)})
    trainer._set_signature_columns_if_needed()
    trainer._signature_columns = list(trainer._signature_columns) + [name]


def _apply_liger_kernels(trainer) -> None:
    """Liger's Triton RMSNorm, SwiGLU and RoPE in the trained model (and a GRPO judge's model): fused
    element-wise passes that also save less for backward (bench/RESULTS.md). The loss stays TRL's:
    `use_liger_kernel=True` would also swap in Liger's fused cross-entropy forward, which a sequence
    classifier lacks (lm_head error) and which TRL's own fused LM head replaces anyway."""
    try:
        from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance
    except ImportError:
        log.warning("liger_kernel: true but the liger-kernel package is missing (pip install liger-kernel==0.8.5): "
                    "training runs without its kernels, slower")
        return
    judges = [getattr(f, "scorer", f) for f in getattr(trainer, "reward_funcs", [])]  # WatchedReward wraps one
    models = [trainer.model] + [getattr(j, "model", None) for j in judges]
    for model in models:
        if model is not None and not getattr(model, "_liger_applied", False):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            _apply_liger_kernel_to_instance(base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                            fused_linear_cross_entropy=False)
            model._liger_applied = True


def _chunk_mlps(model, tokens: int) -> None:
    """Very long inputs: each MLP runs over the sequence in pieces of `tokens`, each checkpointed, so that
    in backward only one piece's 14336-wide intermediates are alive (about 3 GiB less at 32k tokens,
    for one more MLP forward). Applied after Liger, whose SwiGLU it then wraps."""
    from torch.utils.checkpoint import checkpoint
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        def chunked(x, forward=layer.mlp.forward):
            if x.shape[1] <= tokens or not torch.is_grad_enabled():
                return forward(x)
            return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in x.split(tokens, dim=1)],
                             dim=1)
        layer.mlp.forward = chunked


def _unmask_right_padding(model) -> None:
    """A right-padded training batch needs no attention mask: under causal attention no real token sees
    the padding after it, and pad positions carry no loss (labels -100; the reward head reads the last
    real token). Without the mask SDPA runs its flash kernel instead of the masked one, which real-length
    batches otherwise pay for (bench/RESULTS.md). Left padding (GRPO's prompts) keeps its mask."""
    def drop_mask(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if module.training and isinstance(mask, torch.Tensor) and mask.dim() == 2 \
                and bool((mask[:, 1:] <= mask[:, :-1]).all()):
            return args, {**kwargs, "attention_mask": None}
        return None

    model.register_forward_pre_hook(drop_mask, with_kwargs=True)


def _offload_saved_activations(model) -> None:
    """Inside each training forward, keep what autograd saves for backward (with reentrant
    checkpointing: each layer's input) in pinned CPU memory; 32k-token inputs then fit a small GPU."""
    active = []

    def enter(module, args):
        if module.training and torch.is_grad_enabled():
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            ctx.__enter__()
            active.append(ctx)

    def leave(module, args, output):
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


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
    _add_length_column(trainer)
    _unmask_right_padding(trainer.model)
    if getattr(trainer.args, "offload_activations", False):
        _offload_saved_activations(trainer.model)
    if getattr(trainer.args, "liger_kernel", False) and torch.cuda.is_available():  # Triton: GPUs only
        _apply_liger_kernels(trainer)
    if getattr(trainer.args, "mlp_chunk_tokens", 0):
        _chunk_mlps(trainer.model, trainer.args.mlp_chunk_tokens)
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
